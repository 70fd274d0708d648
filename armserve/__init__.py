"""armserve: LLM inference and serving on CPU servers."""

import os as _os

# PyTorch backs allocations of 2 MiB and more with transparent huge pages when this is set before
# its first allocation: decode streams every weight once per token, and 4 KiB pages cost it
# TLB misses (+3% bf16 decode of a 1.1B model here). `THP_MEM_ALLOC_ENABLE=0` opts out.
_os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from armserve.outputs import CompletionOutput, Logprob, RequestOutput
from armserve.sampling_params import SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "Logprob", "__version__"]


def __getattr__(name: str):
    # LLM pulls in torch and transformers: import it only when asked for.
    if name == "LLM":
        from armserve.llm import LLM

        return LLM
    raise AttributeError(name)
