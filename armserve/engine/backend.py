"""What `LLM` and the engine core need from an engine: the whole interface a backend implements.

Two backends implement it: `torch` (armserve's own engine, engine/llm_engine.py) and `openvino`
(OpenVINO GenAI's continuous-batching pipeline, engine/openvino_backend.py). A third backend is
one new file with a class of this shape, its name in config.BACKENDS and a line in `create_engine`.

    LLM / EngineCore                       EngineBackend
    ----------------                       -------------
    add_request(id, prompt, params)  ──►   validate (ValueError naming the problem), queue
    abort_request(ids)               ──►   drop, free the request's cache
    step()                           ◄──   RequestOutput per request that progressed
    scheduler_stats()                ◄──   SchedulerStats for /metrics and the stats line
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, Sequence

from armserve.config import EngineConfig
from armserve.outputs import RequestOutput
from armserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from armserve.engine.stats import SchedulerStats
    from armserve.engine.structured_output import StructuredOutputManager

PromptType = str | list[int] | dict[str, Any]


class EngineBackend(Protocol):
    """One model behind one request queue. Not thread-safe: one thread calls every method."""

    config: EngineConfig
    tokenizer: Any  # a transformers tokenizer: the frontend tokenizes and applies chat templates with it
    max_model_len: int
    # Running totals for the stats line and /metrics.
    num_prompt_tokens_total: int
    num_generation_tokens_total: int
    # Compiles structured-output grammars off the step loop; None if the backend refuses them
    # (its add_request then raises a ValueError naming `structured_outputs`).
    structured: "StructuredOutputManager | None"

    def add_request(self, request_id: str | None, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None, output_kind: str = "final") -> str:
        """Validate and queue a request (raises ValueError naming the problem, engine untouched).
        `output_kind`: "final" (one output at the end), "cumulative" or "delta" (every step)."""
        ...

    def abort_request(self, request_ids: str | Sequence[str]) -> None:
        """Stop requests now; unknown ids are ignored."""
        ...

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> list[RequestOutput]:
        """Advance every running request by one iteration; outputs of those that progressed."""
        ...

    def warm_up(self) -> None:
        """Run a dummy request so the first real one does not pay for first-touch costs."""
        ...

    def scheduler_stats(self) -> "SchedulerStats":
        """The engine's state now: requests running/waiting, KV cache use, prefix cache counters."""
        ...


def create_engine(config: EngineConfig) -> EngineBackend:
    """The engine of `config.backend`."""
    if config.backend == "openvino":
        from armserve.engine.openvino_backend import OpenVINOEngine

        return OpenVINOEngine(config)
    from armserve.engine.llm_engine import LLMEngine

    return LLMEngine(config)
