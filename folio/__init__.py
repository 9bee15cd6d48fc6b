"""folio: an LLM inference and serving engine."""
from folio.outputs import CompletionOutput, Logprob, RequestOutput
from folio.sampling_params import RequestOutputKind, SamplingParams

__version__ = "0.1.0"


def __getattr__(name):
    # LLM pulls in torch and transformers; import it on first use so `import folio` stays light.
    if name == "LLM":
        from folio.entrypoints.llm import LLM
        return LLM
    if name == "LLMEngine":
        from folio.engine.llm_engine import LLMEngine
        return LLMEngine
    raise AttributeError(name)


__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob",
           "RequestOutputKind"]
