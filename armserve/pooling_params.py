"""Per-request pooling parameters (embeddings), with vLLM's names, and the model's pooler configuration
(`PoolerConfig`, applied by layers/pooler.py): plain data the server's front end checks requests against."""

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


POOLING_TYPES = ("CLS", "MEAN", "LAST")


@dataclass(frozen=True, slots=True)
class PoolerConfig:
    """How a model's sequences become vectors (model_loader/pooling.py reads it from the
    checkpoint's sentence-transformers files; layers/pooler.py applies it)."""

    pooling_type: str = "CLS"
    normalize: bool = True
    size: int = 0  # values per vector (the hidden size)
    # Matryoshka models (config `is_matryoshka` / `matryoshka_dimensions`) may be cut to fewer
    # values (`dimensions`); None: not Matryoshka; (): any size up to `size`.
    matryoshka_dimensions: tuple[int, ...] | None = None
    # "embed": vectors; "classify": a cross-encoder's class probabilities (sigmoid of its one
    # logit: a relevance score; softmax over several), `size` of them
    task: str = "embed"
    # How a classifier reads a (query, document) pair (prompts.encode_pair): the tokenizer's pair
    # template (a cross-encoder's [SEP]), else the two texts as one (an LLM reranker), or rendered
    # by a score template (`--chat-template` of a pooling model, vLLM's).
    use_sep_token: bool = True
    score_template: str | None = None

    def check_dimensions(self, dimensions: int | None) -> None:
        """ValueError naming `dimensions` unless this model's vectors can be cut to it."""
        if dimensions is None or dimensions == self.size:
            return
        if self.matryoshka_dimensions is None:
            raise ValueError(f"dimensions: this model does not support Matryoshka representations; its embeddings "
                             f"have {self.size} values and cannot be shortened")
        allowed = self.matryoshka_dimensions
        if dimensions > self.size or (allowed and dimensions not in allowed):
            what = ", ".join(map(str, allowed)) if allowed else f"1 to {self.size}"
            raise ValueError(f"dimensions {dimensions} is not supported by this model; supported: {what}")

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")
