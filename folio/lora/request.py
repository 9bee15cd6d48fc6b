"""vLLM's LoRARequest: which LoRA adapter a request runs with. Shared by every layer (the
offline API and the server build it, the scheduler counts adapters by it, the worker loads
the adapter it names), so it is a plain frozen dataclass that crosses the step messages."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """`lora_name`: the adapter's name (the server's `model`); `lora_int_id`: a positive id,
    unique per adapter (it keys the worker's adapter caches and the prefix cache: two
    adapters must not share one); `lora_path`: the PEFT directory (adapter_config.json and
    adapter_model.safetensors); `base_model_name`: the model it was trained on (listed as the
    adapter's parent by /v1/models)."""
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) \
                or not 1 <= self.lora_int_id < 2**63:
            raise ValueError(f"lora_int_id must be a positive 64-bit int, got "
                             f"{self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must name the adapter's directory, got "
                             f"{self.lora_path!r}")

    # vLLM's accessors
    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    def cache_key(self) -> tuple:
        """What keeps this adapter's prefix-cache blocks apart from the base model's and from
        every other adapter's: its id and name."""
        return ("lora", self.lora_int_id, self.lora_name)
