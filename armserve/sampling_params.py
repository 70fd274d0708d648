"""Per-request sampling parameters, with vLLM's names and defaults."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; the message names the field."""


@dataclass(slots=True)
class StructuredOutputsParams:
    """Constrain a completion to a JSON schema, a regex, one of some strings or an EBNF grammar
    (vLLM's names; exactly one of them). The engine compiles it with xgrammar when the request
    is added, so a bad schema, regex or grammar fails there with a ValueError naming it.

    `json` is a JSON schema (a dict or its JSON text); `json_object=True` asks for any JSON
    object. `disable_any_whitespace` (vLLM's flag) defaults to True here: JSON gets single spaces
    after `:` and `,` and no newlines, because a small model allowed free whitespace often pads
    with newlines until max_tokens.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = True

    def __post_init__(self) -> None:
        given = [k for k in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, k)]
        if len(given) != 1:
            raise SamplingParamsError(
                "structured_outputs needs exactly one of json, regex, choice, grammar, json_object; got "
                + (", ".join(given) if given else "none"))
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as e:
                raise SamplingParamsError(f"structured_outputs.json is not valid JSON: {e}") from None
        if self.json is not None and not isinstance(self.json, dict):
            raise SamplingParamsError(f"structured_outputs.json must be a JSON schema object, got {self.json!r}")
        if self.regex is not None and not isinstance(self.regex, str):
            raise SamplingParamsError(f"structured_outputs.regex must be a string, got {self.regex!r}")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise SamplingParamsError(f"structured_outputs.grammar must be a string, got {self.grammar!r}")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not all(isinstance(c, str) and c for c in self.choice):
                raise SamplingParamsError(
                    f"structured_outputs.choice must be a list of non-empty strings, got {self.choice!r}")
            self.choice = list(self.choice)

    @property
    def kind(self) -> str:
        return next(k for k in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, k))

    def cache_key(self) -> tuple[str, str, bool]:
        """(kind, spec text, whitespace flag): what a compiled grammar is cached under."""
        kind = self.kind
        spec = getattr(self, kind)
        # NOTE: keys keep their order: a schema's property order is the order the JSON is written in.
        text = json.dumps(spec) if kind in ("json", "choice") else str(spec)
        return kind, text, self.disable_any_whitespace


@dataclass(slots=True)
class SamplingParams:
    """How to sample the completion of one prompt.

    Field names follow vLLM's `SamplingParams`. `top_k` of 0 or -1 disables top-k;
    `temperature` 0 means greedy. `logprobs`/`prompt_logprobs` ask for that many
    top alternatives per position (the chosen token is always included).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    # Filled by the engine: stop_token_ids plus EOS (unless ignore_eos).
    _all_stop_token_ids: set[int] = field(default_factory=set, repr=False, init=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()
        self._all_stop_token_ids = set(self.stop_token_ids)

    def _validate(self) -> None:
        def bad(name: str, why: str) -> None:
            raise SamplingParamsError(f"{name} {why}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or self.n < 1:
            bad("n", "must be an integer >= 1")
        if self.temperature < 0.0:
            bad("temperature", "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", "must be -1 or 0 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", "must be in [-2, 2]")
        if self.repetition_penalty <= 0.0:
            bad("repetition_penalty", "must be > 0")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", "must be an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                bad(name, "must be an integer >= 0")
        if self.stop and not self.detokenize:
            bad("stop", "needs detokenize=True (stop strings are matched on text)")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", "must be an integer")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative integers")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            bad("structured_outputs", "must be a StructuredOutputsParams")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def all_stop_token_ids(self) -> set[int]:
        return self._all_stop_token_ids

    def update_from_generation_config(self, eos_token_ids: set[int]) -> None:
        """Called by the engine: EOS counts as a stop token unless `ignore_eos`."""
        ids = set(self.stop_token_ids)
        if not self.ignore_eos:
            ids |= eos_token_ids
        self._all_stop_token_ids = ids

    def clone(self, **changes) -> "SamplingParams":
        """A copy with some fields changed (used to fan out n > 1)."""
        p = replace(self, **changes)
        p._all_stop_token_ids = set(self._all_stop_token_ids)
        return p
