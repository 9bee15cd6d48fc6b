"""LoRA adapters as requests name them (vLLM's vllm.lora.request path): shared by every layer."""
from folio.lora.request import LoRARequest

__all__ = ["LoRARequest"]
