"""Pooling: one vector per sequence from its token rows (vLLM's pooler, sentence-transformers'
Pooling + Normalize modules).

    CLS   the first token's row (BERT-style [CLS])
    MEAN  the mean of every token's row
    LAST  the last token's row (decoder embedders: Qwen3-Embedding, e5-mistral)

then, when `normalize`, scaled to unit L2 norm; `dimensions` (Matryoshka models) keeps the first
d values before normalizing, as sentence-transformers' `truncate_dim` does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
