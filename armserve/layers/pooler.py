"""Pooling: one vector per sequence from its token rows (vLLM's pooler, sentence-transformers'
Pooling + Normalize modules).

    CLS   the first token's row (BERT-style [CLS])
    MEAN  the mean of every token's row
    LAST  the last token's row (decoder embedders: Qwen3-Embedding, e5-mistral)

then, when `normalize`, scaled to unit L2 norm; `dimensions` (Matryoshka models) keeps the first
d values before normalizing, as sentence-transformers' `truncate_dim` does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

POOLING_TYPES = ("CLS", "MEAN", "LAST")


@dataclass(frozen=True, slots=True)
class PoolerConfig:
    """How a model's sequences become vectors (model_loader/pooling.py reads it from the
    checkpoint's sentence-transformers files)."""

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


def pool(hidden: torch.Tensor, seq_lens: list[int], pooling_type: str) -> torch.Tensor:
    """[num_seqs, hidden] float32 rows pooled from `hidden` [sum(seq_lens), hidden]."""
    lens = torch.tensor(seq_lens)
    ends = lens.cumsum(0)
    starts = ends - lens
    if pooling_type == "CLS":
        return hidden[starts].float()
    if pooling_type == "LAST":
        return hidden[ends - 1].float()
    seq = torch.repeat_interleave(torch.arange(len(seq_lens)), lens)
    sums = torch.zeros(len(seq_lens), hidden.shape[1], dtype=torch.float32).index_add_(0, seq, hidden.float())
    return sums / lens[:, None].float()


def classify_probs(logits: torch.Tensor) -> torch.Tensor:
    """A cross-encoder's logits [rows, labels] as probabilities: sigmoid of a single logit (what
    sentence-transformers' CrossEncoder returns), softmax over several."""
    return torch.sigmoid(logits) if logits.shape[-1] == 1 else torch.softmax(logits, dim=-1)


def finish(vector: torch.Tensor, normalize: bool, dimensions: int | None = None) -> torch.Tensor:
    """A pooled row as it is returned: cut to `dimensions` (Matryoshka), then unit length when
    `normalize`."""
    if dimensions is not None:
        vector = vector[..., :dimensions]
    return F.normalize(vector, p=2, dim=-1) if normalize else vector
