"""The commands a front end (engine/async_llm.py) sends an engine core (engine/core.py). Plain data,
importable without the engine: the server's front end never loads torch or the model code."""

from __future__ import annotations

from dataclasses import dataclass

from armserve.engine.input_processor import EngineCoreRequest


@dataclass(slots=True)
class AddCommand:
    request: EngineCoreRequest  # made by the frontend's input processor
    compiled: bool = False  # the structured-output grammar is in the core's cache


@dataclass(slots=True)
class AbortCommand:
    request_ids: list[str]


class StopCommand:
    pass
