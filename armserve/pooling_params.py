"""Per-request pooling parameters (embeddings), with vLLM's names."""

from __future__ import annotations

from dataclasses import dataclass


class PoolingParamsError(ValueError):
    """A pooling parameter is out of range; the message names the field."""


@dataclass(slots=True)
class PoolingParams:
    """How one input becomes a vector.

    `dimensions`: keep the first d values (Matryoshka models only; the engine refuses it for
    others). `normalize`: unit length (None: as the model's pooling says). `truncate_prompt_tokens`:
    cut an input longer than k tokens to k on the tokenizer's truncation side (-1: max_model_len)
    instead of refusing it.
    """

    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise PoolingParamsError(f"dimensions must be a positive integer, got {self.dimensions!r}")
        t = self.truncate_prompt_tokens
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or (t < 1 and t != -1)):
            raise PoolingParamsError(f"truncate_prompt_tokens must be -1 or a positive integer, got {t!r}")

    def max_tokens(self, max_model_len: int) -> int | None:
        """The most tokens an input keeps (`truncate_prompt_tokens`, -1 and anything larger meaning
        max_model_len), or None: not cut."""
        t = self.truncate_prompt_tokens
        return None if t is None else (max_model_len if t == -1 else min(t, max_model_len))
