"""Decoder families as pooling models (vLLM's `as_embedding_model` / `as_seq_cls_model`): the
same layers and weights, run by the pooling runner (engine/pooling_backend.py) instead of the
generation engine.

- No KV cache: a sequence runs whole in one step, so each is a fresh causal prefill over its own
  rows (layers/attention.py's PyTorch path, `scaled_dot_product_attention` with a causal mask,
  sliding windows included). `forward(ids, positions, seq_lens)` publishes that step's metadata.
- The hidden rows are the final norm's output: what the LM head would read (Qwen3-Embedding,
  gte-Qwen2, e5-mistral pool them: LAST by default, or as the checkpoint's 1_Pooling says).
- No LM head is built. A sequence classifier (`*ForSequenceClassification`, Qwen3-Reranker)
  scores the last row with `score` [num_labels, hidden]: a converted checkpoint's `score.weight`,
  or rows of the LM head picked by `classifier_from_token` (vLLM's `hf_overrides` for the original
  Qwen3-Reranker: `["no", "yes"]` with `is_original_qwen3_reranker`, one logit
  `w_yes - w_no`, whose sigmoid is the softmax of the two tokens' logits: P("yes")).
"""

from __future__ import annotations

import functools
from typing import Iterable

import torch
from torch import nn

from armserve.layers.attention import AttentionMetadata, PrefillChunk, set_attention_metadata
from armserve.layers.linear import Linear
from armserve.quantization import QuantizedLinear, QuantizedTensor


def causal_metadata(seq_lens: list[int], positions: torch.Tensor) -> AttentionMetadata:
    """One step of whole sequences back to back, each a fresh prefill (no cache)."""
    chunks, start = [], 0
    none = torch.empty(0, dtype=torch.long)
    for n in seq_lens:
        chunks.append(PrefillChunk(start, n, n, none, positions[start:start + n], fresh=True))
        start += n
    return AttentionMetadata(slot_mapping=none, num_decodes=0, prefills=chunks)


def two_way_softmax(config) -> bool:
    """vLLM's `from_2_way_softmax`: two classifier tokens [false, true] read as one logit."""
    return bool(getattr(config, "is_original_qwen3_reranker", False)) or \
        getattr(config, "method", None) == "from_2_way_softmax"


def _last_rows(hidden: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
    return hidden[torch.tensor(seq_lens).cumsum(0) - 1]


@functools.cache
def as_pooling_model(cls: type[nn.Module], task: str = "embed", architecture: str | None = None) -> type[nn.Module]:
    """`cls` (a decoder family, models/llama.py's LlamaForCausalLM or a subclass) as a pooling
    model: "embed" (hidden rows) or "classify" (`score` logits of the last row). `architecture`:
    the config.json name it answers to (None: made at run time for `--runner pooling`)."""

    class Pooling(cls):  # type: ignore[misc, valid-type]
        architectures = (architecture,) if architecture else ()
        model_types: tuple[str, ...] = ()
        gguf_architectures: tuple[str, ...] = ()
        is_pooling_model = True
        pooling_task = task
        default_pooling_type = "LAST"  # vLLM's default for decoder embedders
        position_offset_from_pad = False
        uses_sep_token = False  # a pair is the two texts as one (vLLM's LLM-as-reranker)
        has_lm_head = False

        def __init__(self, config) -> None:
            super().__init__(config)
            if any(type(m).__name__ == "MLAAttention" for m in self.modules()):
                raise ValueError(f"{cls.__name__} (multi-head latent attention) cannot run as a pooling model")
            self.sep_token_id: int | None = None  # (the encoders' token types: not used here)
            self.score: Linear | None = None
            self.classifier_rows: torch.Tensor | None = None  # LM head rows of the classifier tokens
            if task == "classify":
                self.token_ids = list(getattr(config, "classifier_token_ids", None) or ())
                if self.token_ids:
                    config.num_labels = 1 if two_way_softmax(config) else len(self.token_ids)
                self.score = Linear(config.hidden_size, config.num_labels, bias=False)
            for p in self.parameters():
                p.requires_grad_(False)

        @property
        def max_positions(self) -> int:
            return self.config.max_position_embeddings

        def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, seq_lens: list[int],
                    token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
            set_attention_metadata(causal_metadata(seq_lens, positions))
            try:
                return super().forward(input_ids, positions)
            finally:
                set_attention_metadata(None)

        def classify(self, hidden: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
            """float32 logits [num_seqs, num_labels] of each sequence's last row."""
            assert self.score is not None
            return self.score(_last_rows(hidden, seq_lens)).float()

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedTensor]]) -> set[str]:
            def stream():
                for name, tensor in weights:
                    if name == "score.weight" and getattr(self.config, "score_rows_true_false", False):
                        # a reranker GGUF's [yes, no] rows (model_loader/gguf.py rank_config): one logit
                        rows = tensor.dequantize() if isinstance(tensor, QuantizedTensor) else tensor
                        tensor = (rows[0:1].float() - rows[1:2].float())
                    if name == "lm_head.weight":  # no head; a token classifier keeps its rows
                        if task == "classify" and self.token_ids:
                            rows = tensor.dequantize() if isinstance(tensor, QuantizedTensor) else tensor
                            self.classifier_rows = rows[self.token_ids].float()
                        continue
                    yield name, tensor

            loaded = super().load_weights(stream())
            if task == "classify" and self.token_ids:
                loaded.add("score.weight")
                rows = self.embed_tokens.weight.data[self.token_ids].float() if self.tie_word_embeddings \
                    else self.classifier_rows
                if rows is None:
                    raise ValueError("classifier_from_token reads the LM head, and the checkpoint has no lm_head.weight")
                if two_way_softmax(self.config):
                    if len(self.token_ids) != 2:
                        raise ValueError("is_original_qwen3_reranker / from_2_way_softmax needs two "
                                         f"classifier_from_token (false, true), got {len(self.token_ids)}")
                    rows = rows[1:2] - rows[0:1]
                self.score.weight.data.copy_(rows)
            return loaded

        def process_weights_after_loading(self) -> None:
            """Prepack the linear layers once (no LM head, so no packed copy of a tied table)."""
            for m in self.modules():
                if isinstance(m, (Linear, QuantizedLinear)):
                    m.finalize()

    Pooling.__name__ = Pooling.__qualname__ = architecture or f"{cls.__name__}For{task.capitalize()}"
    return Pooling
