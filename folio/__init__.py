"""folio: an LLM inference and serving engine."""
from folio.lora.request import LoRARequest
from folio.request_outputs import CompletionOutput, Logprob, RequestOutput
from folio.sampling_params import RequestOutputKind, SamplingParams
from folio.structured_output.params import StructuredOutputsParams

__version__ = "0.1.0"

# Heavier names (torch, transformers, zmq) are imported on first use, so `import folio` stays
# light: name -> module that defines it.
_LAZY = {
    "LLM": "folio.entrypoints.llm",
    "LLMEngine": "folio.engine.llm_engine",
    "AsyncLLM": "folio.engine.async_llm",
    "PromptType": "folio.engine.input_processor",
}


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


__all__ = ["LLM", "LLMEngine", "AsyncLLM", "SamplingParams", "StructuredOutputsParams",
           "RequestOutput", "CompletionOutput", "Logprob", "RequestOutputKind", "PromptType",
           "LoRARequest"]
