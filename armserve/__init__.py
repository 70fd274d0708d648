"""armserve: LLM inference and serving on CPU servers."""

from armserve.outputs import CompletionOutput, Logprob, RequestOutput
from armserve.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "__version__"]


def __getattr__(name: str):
    # LLM pulls in torch and transformers: import it only when asked for.
    if name == "LLM":
        from armserve.llm import LLM

        return LLM
    raise AttributeError(name)
