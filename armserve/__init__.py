"""armserve: LLM inference and serving on CPU servers."""

import os as _os

# PyTorch backs allocations of 2 MiB and more with transparent huge pages when this is set before
# its first allocation: decode streams every weight once per token, and 4 KiB pages cost it
# TLB misses (+3% bf16 decode of a 1.1B model here). `THP_MEM_ALLOC_ENABLE=0` opts out.
_os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

# The engine's thread team waits at a barrier hundreds of times a step, so it spins a while before
# it sleeps (libgomp's default). OMP_WAIT_POLICY=PASSIVE, set by some container images and HPC
# setups, makes every wait a sleep and a wake-up and halved a 2-thread decode (24.6 vs 49.9
# tok/s): the engine drops it and keeps libgomp's spin-then-sleep default. OpenMP reads it once,
# when PyTorch loads it, so this runs before torch; engine-core processes inherit the environment.
# cpu.init_threads says what was done; ARMSERVE_KEEP_OMP_WAIT_POLICY=1 keeps the environment's.
OMP_WAIT_POLICY_DROPPED: str | None = None
OMP_LOADED_BEFORE_ARMSERVE = "torch" in __import__("sys").modules
if (_os.environ.get("ARMSERVE_KEEP_OMP_WAIT_POLICY", "0") in ("", "0")
        and _os.environ.get("OMP_WAIT_POLICY", "").strip().upper() == "PASSIVE"):
    OMP_WAIT_POLICY_DROPPED = _os.environ.pop("OMP_WAIT_POLICY")

from armserve.outputs import CompletionOutput, Logprob, RequestOutput
from armserve.pooling_params import PoolingParams
from armserve.sampling_params import SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "PoolingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "Logprob", "__version__"]


def __getattr__(name: str):
    # LLM pulls in torch and transformers: import it only when asked for.
    if name == "LLM":
        from armserve.llm import LLM

        return LLM
    raise AttributeError(name)
