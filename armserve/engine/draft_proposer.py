"""Speculative decoding with a draft model (`speculative_config` method "draft_model"): a smaller
model with the target's tokenizer, or the target itself quantized to int4 at load (quantized
self-drafting), proposes k tokens greedily for every decoding request of a step.

A quantized draft head computes logits over part of the vocabulary only (`draft_vocab_size`: the
first ids, which BPE and SentencePiece vocabularies order roughly by frequency, and the special
tokens), mapped back to the target's ids (`draft_to_target`, as an EAGLE-3 head's d2t): a draft step
reads its whole head, 151,936 rows for Qwen2.5. A token outside it is never drafted, only verified.

The draft has a KV cache of its own, in the same block layout and under the same block ids as the
target's: a request's block table serves both, so the draft needs no block manager. Each request
remembers how many of its leading tokens have draft KV (`SpecState.draft_computed`); a step

    catch-up   one forward over every request's tokens the draft has not seen yet (the prompt
               on first use, afterwards the 1-2 tokens the last verification added: a replayed
               step graph of 1 or 2 rows per request) -> d_0
    j = 1..k-1 one single-token forward per draft position over the requests still drafting
               (a replayed step graph where the batch allows) -> d_j

A rejection rolls `draft_computed` back with the target's `num_computed_tokens`, a preemption
resets it. Draft KV that is stale (a prefix-cache hit on blocks another request filled, say) can
only lower acceptance, never change an output: the target verifies every token. The draft
proposes its argmax, a point mass, so the rejection rule is the n-gram one
(engine/rejection_sampler.py).
"""

from __future__ import annotations

import torch

from armserve import kernels
from armserve.config import ConfigError, SpeculativeConfig, cache_dir
from armserve.engine.request import Request
from armserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from armserve.engine.spec_decode import SpecState, draft_limit, request_state
from armserve.layers.attention import set_attention_metadata


class _View:
    """What the runner's step preparation reads of a request, for a draft forward."""

    __slots__ = ("num_computed_tokens", "all_token_ids")

    def __init__(self, num_computed_tokens: int, all_token_ids: list[int]) -> None:
        self.num_computed_tokens = num_computed_tokens
        self.all_token_ids = all_token_ids


class DraftModelProposer:
    """Greedy drafts from a second model (`runner`: its ModelRunner, on the target's block ids)."""

    batched = True  # proposes for all of a step's requests at once, after their slots are allocated

    def __init__(self, config: SpeculativeConfig, runner) -> None:
        self.config = config
        self.runner = runner
        self.k = config.num_speculative_tokens
        self.step = 0

    def state(self, req: Request) -> SpecState | None:
        return request_state(req, 1, 0, self.k)  # (no n-gram tables)

    def _argmax(self, logits: torch.Tensor) -> list[int]:
        """Greedy draft tokens, as the target's ids, from float32 logits [rows, draft vocabulary]."""
        ids = kernels.argmax(logits)
        to_target = getattr(self.runner.model, "draft_to_target", None)
        return (ids if to_target is None else to_target.index_select(0, ids)).tolist()

    def draft_length(self, req: Request, limit: int) -> int:
        """How many tokens to draft for `req` this step (its adaptive k, capped by `limit`)."""
        return draft_limit(self.state(req), self.step, limit)

    @torch.inference_mode()
    def propose_batch(self, items: list[tuple[Request, int, list[int]]]) -> list[list[int]]:
        """Drafts for (request, tokens to draft, its block ids) each, in order."""
        drafts: list[list[int]] = [[] for _ in items]
        rows = []
        for i, (req, k, blocks) in enumerate(items):
            st: SpecState = req.spec  # type: ignore[assignment]
            if st.epoch != req.num_preemptions:  # recomputed into other blocks
                st.epoch, st.draft_computed = req.num_preemptions, 0
            # (after a rejection only the accepted tokens' draft KV is valid)
            st.draft_computed = min(st.draft_computed, req.num_computed_tokens)
            rows.append((i, req, k, blocks))
        # catch-up over the unseen known tokens: its last row predicts d_0
        sched = [ScheduledRequest(_View(req.spec.draft_computed, req.all_token_ids),  # type: ignore[arg-type]
                                  req.num_tokens - req.spec.draft_computed, blocks)
                 for _, req, _, blocks in rows]
        tokens = None
        if self.runner.graphs.enabled and all(s.num_new_tokens <= 2 for s in sched):
            # the usual case (the last run accepted in full adds 2 tokens): a replayed step, with
            # 2 rows per sequence (a verify-shaped graph: about the cost of one row for a small
            # int4 draft) when some sequence is two behind
            news = [s.num_new_tokens for s in sched]
            if max(news) == 2:
                out = self.runner.graphs.run_verify([req.all_token_ids[-n:] for (_, req, _, _), n in zip(rows, news)],
                                                    [req.num_tokens - n for (_, req, _, _), n in zip(rows, news)],
                                                    [b for *_, b in rows])
                if out is not None:
                    logits, q = out
                    last = torch.tensor([i * q + n - 1 for i, n in enumerate(news)], dtype=torch.long)
                    tokens = self._argmax(logits.index_select(0, last).float().contiguous())
                else:  # single-token steps, the first only for the KV of the rows two behind
                    two = [r for r, n in zip(rows, news) if n == 2]
                    self._decode([req.all_token_ids[-2] for _, req, _, _ in two],
                                 [req.num_tokens - 2 for _, req, _, _ in two], [b for *_, b in two])
            if tokens is None:
                tokens = self._decode([req.all_token_ids[-1] for _, req, _, _ in rows],
                                      [req.num_tokens - 1 for _, req, _, _ in rows], [b for *_, b in rows])
        else:
            tokens = self._eager(sched)
        for (i, req, _, _), t in zip(rows, tokens):
            drafts[i].append(t)
        for j in range(1, max((k for _, _, k, _ in rows), default=0)):
            rows = [r for r in rows if r[2] > j]
            tokens = self._decode([drafts[i][-1] for i, *_ in rows], [req.num_tokens + j - 1 for _, req, _, _ in rows],
                                  [b for *_, b in rows])
            for (i, *_), t in zip(rows, tokens):
                drafts[i].append(t)
        for (req, k, _), d in zip(items, drafts):
            req.spec.draft_computed = req.num_tokens + len(d) - 1  # type: ignore[union-attr]
        return drafts

    def _decode(self, ids: list[int], positions: list[int], blocks: list[list[int]]) -> list[int]:
        """Argmax of a single-token step per row: a replayed step graph, else eagerly."""
        logits = self.runner.graphs.run(ids, positions, blocks) if self.runner.graphs.enabled else None
        if logits is None:
            sched = [ScheduledRequest(_View(p, []), 1, b, [t])  # type: ignore[arg-type]
                     for t, p, b in zip(ids, positions, blocks)]
            return self._eager(sched)
        return self._argmax(logits.float().contiguous())

    def _eager(self, sched: list[ScheduledRequest]) -> list[int]:
        runner = self.runner
        input_ids, positions, md, row_end, _ = runner._prepare(SchedulerOutput(sched))
        set_attention_metadata(md)
        try:
            hidden = runner.model(input_ids, positions)
        finally:
            set_attention_metadata(None)
        logits = runner.model.compute_logits(hidden.index_select(0, torch.tensor(row_end, dtype=torch.long)))
        return self._argmax(logits.float().contiguous())


def load_draft_model(spec: SpeculativeConfig, target_config, dtype: torch.dtype, special_ids: set[int]):
    """(the draft model, its config): `spec.model` as its checkpoint is, or with quantization
    "w4a8" an int4 copy made once by `armserve quantize`'s code and kept in
    $ARMSERVE_SELF_DRAFT_CACHE (default ~/.cache/armserve/self-draft); a quantized head limited to
    `spec.draft_vocab_size` ids and `special_ids`. A ConfigError when its vocabulary is not the
    target's."""
    from armserve import model_loader

    src = model_loader.resolve_model_path(spec.model)  # type: ignore[arg-type]
    if spec.quantization == "w4a8":
        src = model_loader.resolve_model_path(_int4_copy(src.path, dtype))
    config = model_loader.load_config(src)
    if config.vocab_size != target_config.vocab_size:
        raise ConfigError(f"speculative_config: the draft model {spec.model!r} has a vocabulary of "
                          f"{config.vocab_size} tokens, the target {target_config.vocab_size}; a draft must "
                          "share the target's tokenizer")
    model = model_loader.load_model(src, config, dtype)
    limit_draft_vocabulary(model, spec.draft_vocab_size, special_ids)  # type: ignore[arg-type]
    return model, config


def limit_draft_vocabulary(model, size: int, special_ids: set[int]) -> None:
    """Keep of `model`'s head the rows of ids < `size` and of `special_ids` (in whole 16-row tiles:
    their packed bytes are copied as they are, so every kept logit is the full head's, bit for bit)
    and set `model.draft_to_target`; nothing when `size` is 0 or covers the vocabulary, or the head
    is not one quantized layer (a tied or float head: its layout is the embedding's or the dense
    GEMM's)."""
    import logging

    from armserve.quantization.linear import QuantizedLinear

    head = getattr(model, "lm_head", None)
    if not size or not isinstance(head, QuantizedLinear) or len(head.parts) != 1 or size >= head.out_features:
        return
    tiles = sorted(set(range(-(-size // 16))) | {i // 16 for i in special_ids if 0 <= i < head.out_features})
    model.lm_head, model.draft_to_target = head.keep_row_tiles(tiles)
    logging.getLogger("armserve").info("draft LM head: %d of %d token ids (draft_vocab_size %d and the special "
                                       "tokens)", model.draft_to_target.numel(), head.out_features, size)


def _int4_copy(path: str, dtype: torch.dtype) -> str:
    import hashlib
    import logging
    import os
    import shutil

    from armserve.quantization.quantize import quantize_model

    keep = "float32" if dtype == torch.float32 else "bfloat16"
    st = os.stat(path)
    # ("untied": copies made before the head was untied are not reused)
    key = hashlib.sha1(repr((os.path.abspath(path), st.st_mtime_ns, st.st_size, keep, "untied")).encode()).hexdigest()[:16]
    root = os.environ.get("ARMSERVE_SELF_DRAFT_CACHE") or cache_dir("self-draft")
    out = os.path.join(root, key)
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    logging.getLogger("armserve").info("making the int4 self-draft copy of %s in %s (once)", path, out)
    tmp = f"{out}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(root, exist_ok=True)
    # (the head in int8 even where the target ties it to its table: a draft step reads it whole)
    quantize_model(path, tmp, scheme="w4a8", dtype=keep, progress=False, untie_lm_head=True)
    try:
        os.replace(tmp, out)
    except OSError:  # another process made it first
        shutil.rmtree(tmp, ignore_errors=True)
    return out
