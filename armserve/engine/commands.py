"""The commands a front end (engine/async_llm.py) sends an engine core (engine/core.py). Plain data,
importable without the engine: the server's front end never loads torch or the model code."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from armserve.engine.input_processor import EngineCoreRequest


@dataclass(slots=True)
class AddCommand:
    request: EngineCoreRequest  # made by the frontend's input processor
    compiled: bool = False  # the structured-output grammar is in the core's cache


@dataclass(slots=True)
class AbortCommand:
    request_ids: list[str]
    # (request id, completion index) of sequences to stop, the rest of their request going on:
    # the completions a stop string ended (the front end's output processor finds them)
    sequences: list[tuple[str, int]] = field(default_factory=list)


@dataclass(slots=True)
class LoRACommand:
    """Read an adapter into the engine's LoRA cache (`lora_request`: a lora.LoRARequest, checked
    against the model) or forget one (`remove`: its lora_int_id); answered ("lora", token, error)."""

    token: str
    lora_request: Any = None
    remove: int | None = None


class StopCommand:
    pass
