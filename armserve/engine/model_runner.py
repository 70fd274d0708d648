"""Turns a scheduled step into tensors, runs the model over the paged KV cache and samples."""

from __future__ import annotations

import logging
import os
import pickle
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from armserve.engine.sampler import (
    LogprobsTensors,
    Sampler,
    build_sampling_batch,
    compute_logprobs_tensors,
)
from armserve import kernels
from armserve.engine.rejection_sampler import rejection_sample
from armserve.engine.scheduler import SchedulerOutput
from armserve.engine.step_graph import MAX_GRAPH_BATCH, StepGraphs, graph_batch
from armserve.layers.attention import AttentionMetadata, PrefillChunk, kv_cache_shapes, set_attention_metadata
from armserve.layers.lora import set_lora_indices
from armserve.memory import MADV_HUGEPAGE, madvise


KV_SCALE_DTYPE = torch.float32  # one scale per (slot, kv head) of an int8 cache


def kv_cache_rows(config, tensor_parallel_size: int = 1) -> tuple[int, int]:
    """(rows cached per token per layer, values per row) for this model: K and V of every kv
    head (of the largest tensor-parallel rank's share of them), or with Multi-head Latent Attention
    (DeepSeek: `kv_lora_rank` in the config) one row of the latent plus the rotary key part
    (layers/mla.py)."""
    if getattr(config, "kv_lora_rank", None):
        return 1, config.kv_lora_rank + config.qk_rope_head_dim
    n_heads = config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or n_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
    return 2 * -(-n_kv // tensor_parallel_size), head_dim


def kv_cache_bytes_per_token(config, cache_dtype: torch.dtype, tensor_parallel_size: int = 1) -> int:
    """Bytes of cache one token takes over all layers (on one tensor-parallel rank). An int8 row
    also carries float32 scales (one per K/V row; MLA's latent and rotary parts have one each)."""
    rows, width = kv_cache_rows(config, tensor_parallel_size)
    row_bytes = width * torch.tensor([], dtype=cache_dtype).element_size()
    if cache_dtype == torch.int8:
        row_bytes += KV_SCALE_DTYPE.itemsize * (2 if getattr(config, "kv_lora_rank", None) else 1)
    return config.num_hidden_layers * rows * row_bytes


def kv_cache_num_blocks(config, kv_cache_space_gib: float, block_size: int, cache_dtype: torch.dtype,
                        tensor_parallel_size: int = 1) -> int:
    """How many blocks of `block_size` tokens fit in `kv_cache_space_gib` for this model.

    `cache_dtype` is what the cache stores (the model dtype, or torch.int8). An int8 row of
    head_dim bytes also carries a float32 scale, so int8 holds 2 * hd / (hd + 4) times the tokens
    of a bfloat16 cache (1.88x at head_dim 64, 1.94x at 128).
    """
    return int(kv_cache_space_gib * (1 << 30)) // (
        block_size * kv_cache_bytes_per_token(config, cache_dtype, tensor_parallel_size))


PROMPT_LOGPROBS_SLICE = 256


_log = logging.getLogger("armserve")
_HUGE_PAGE = 2 << 20


def _thp_mode() -> str:
    """The kernel's transparent-huge-page mode ("always", "madvise", "never"), "" if unknown."""
    try:
        words = open("/sys/kernel/mm/transparent_hugepage/enabled").read().split()
    except OSError:
        return ""
    return next((w[1:-1] for w in words if w.startswith("[")), "")


def huge_pages_wanted() -> bool:
    """Whether to advise huge pages for the KV cache: the kernel allows them, and PyTorch's own switch
    for its allocations (`THP_MEM_ALLOC_ENABLE`, on by default: armserve/__init__.py) is not set to
    0. One switch for both: on a VM whose huge-page first touch is slow (3.5x 4 KiB pages' time per
    MiB on the 2-core EPYC VMs here) a user turns huge pages off for the whole engine at once."""
    return _thp_mode() in ("always", "madvise") and os.environ.get("THP_MEM_ALLOC_ENABLE", "1").strip() != "0"


def prefault_kv_cache(cache: torch.Tensor) -> None:
    """Back the KV cache with huge pages where the kernel allows (fewer TLB misses across scattered
    blocks) and write it once, now: otherwise each block's first write pays the page faults inside
    a request (measured on a 2-core VM: ~45 ms of a 1024-token prompt's 720 ms time to first token,
    about 2.3 ms per MB touched). vLLM zero-fills its cache at start-up the same way.
    `ARMSERVE_KV_PREFAULT=0` leaves the pages to be touched on first use (faster start-up)."""
    if os.environ.get("ARMSERVE_KV_PREFAULT", "").strip() == "0" or cache.numel() == 0:
        return
    t = time.perf_counter()
    nbytes = cache.numel() * cache.element_size()
    if huge_pages_wanted() and nbytes >= 2 * _HUGE_PAGE:
        start = -(-cache.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE
        end = (cache.data_ptr() + nbytes) // _HUGE_PAGE * _HUGE_PAGE
        madvise(start, end - start, MADV_HUGEPAGE)  # advice only: failure changes nothing
    cache.view(torch.uint8).view(-1).zero_()
    took = time.perf_counter() - t
    if took > 1.0:
        _log.info("KV cache of %.1f GiB paged in in %.1f s (ARMSERVE_KV_PREFAULT=0 skips this)", nbytes / 2**30, took)


# ---- tensor parallelism: one step's inputs for ranks 1..N-1 (armserve/distributed.py) ----------


@dataclass
class TPStepInputs:
    """What a worker needs to run one step as rank 0 does: the token rows, the attention layout
    (numpy arrays on the kernel path, the PyTorch path's metadata object otherwise) and the rows
    `compute_logits` is called on, in order (each a list of row indices)."""

    input_ids: Any
    positions: Any
    kernel: tuple | None  # (slot_mapping, num_decodes, q_start, q_len, context_len, block_tables)
    metadata: Any  # AttentionMetadata (PyTorch path) or None
    logit_rows: list[list[int]]


def tp_step_inputs(input_ids: torch.Tensor, positions: torch.Tensor, md, logit_rows: list[list[int]]) -> bytes:
    """rank 0: one step's inputs as bytes for the workers' pipes."""
    if md.kernel_batch is not None:
        q_start, q_len, ctx, tables = md.kernel_batch._keepalive
        kernel = (md.slot_mapping.numpy(), md.num_decodes, q_start.numpy(), q_len.numpy(), ctx.numpy(),
                  tables.numpy())
        msg = TPStepInputs(input_ids.numpy(), positions.numpy(), kernel, None, logit_rows)
    else:
        msg = TPStepInputs(input_ids.numpy(), positions.numpy(), None, md, logit_rows)
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


@dataclass
class ModelRunnerOutput:
    sampled: list[int | None]  # one per scheduled request; None for a mid-prompt chunk
    # (token ids, logprobs, rank) per request; a list of them, one per emitted token, for a request
    # that verified drafts
    logprobs: list[Any]
    prompt_logprobs: dict[str, LogprobsTensors]  # request id -> this chunk's prompt logprobs
    # scheduled index -> its accepted draft tokens (speculative decoding), which come before `sampled`
    accepted: dict[int, list[int]] | None = None
    # EAGLE-3 / MTP (`ModelRunner.keep_aux`): the target's kept hidden states [rows, layers x hidden], each
    # scheduled request's query rows (drafts included) one after another, in schedule order
    aux_hidden: torch.Tensor | None = None


class ModelRunner:
    """Owns the paged KV cache and runs the model over one scheduled step at a time.

    Cache layout (one allocation; layer i's K is kv_cache[0, i], its V kv_cache[1, i], each seen
    in the block layout of layers/attention.py, K with its 16-key tiles transposed):

        kv_cache  [2, layers, num_blocks + 1, kv_heads, block_size, head_dim]   cache_dtype
        kv_scales [2, layers, num_blocks + 1, kv_heads, block_size]             float32, int8 cache only

    or, for a model with Multi-head Latent Attention (its attention layers have a `latent_dim`),
    one latent row per token per layer (layers/mla.py):

        kv_cache  [layers, num_blocks + 1, block_size, kv_lora_rank + rope_dim]  cache_dtype
        kv_scales [layers, num_blocks + 1, block_size, 2]                        float32, int8 cache only

    (block `num_blocks` is no sequence's: step-graph padding rows write there). A scale lives in the same block as its row, so anything that keeps a block (prefix caching)
    keeps its scales with it.
    """

    def __init__(self, model: nn.Module, num_blocks: int, block_size: int, dtype: torch.dtype,
                 cache_dtype: torch.dtype | None = None, max_model_len: int | None = None,
                 enforce_eager: bool = False, tp_workers=None, lora=None) -> None:
        self.model = model
        self.lora = lora  # lora/manager.py's LoRAManager when the engine serves adapters
        # Tensor parallel rank 0: each step's inputs go to the other ranks (distributed.TPWorkers),
        # which run the same forward. NOTE: no step graphs under tensor parallelism: a replay would
        # need the all-reduce as a recordable kernel and every rank replaying in step (what eager
        # steps cost is in docs/scaling.md's tensor-parallel measurement).
        self.tp_workers = tp_workers
        enforce_eager = enforce_eager or tp_workers is not None
        self.block_size = block_size
        self.dtype = dtype
        self.cache_dtype = cache_dtype or dtype
        if self.cache_dtype not in (dtype, torch.int8):
            raise ValueError(f"KV cache dtype {self.cache_dtype} is neither the model dtype {dtype} nor int8")
        cfg = model.config
        self.vocab_size = cfg.vocab_size
        attn_layers = model.attention_layers()
        a0 = attn_layers[0]
        slots = num_blocks * block_size
        self.sampler = Sampler()
        self.structured = None  # the engine's StructuredOutputManager, once a request needs one
        self.keep_aux = False  # EAGLE-3 / MTP: return the model's `aux_hidden` rows with each step's output
        max_blocks = -(-(max_model_len or slots) // block_size)
        if getattr(a0, "latent_dim", None):
            self._allocate_latent(attn_layers, num_blocks)
            # MLA attends in PyTorch (layers/mla.py): the step metadata is the PyTorch path's, and
            # decode steps cannot be replayed from kernel recordings.
            self.use_kernels = False
            self.graphs = StepGraphs(model, min(max_blocks, num_blocks), block_size, enabled=False,
                                     pad_block=num_blocks)
            return
        # One block more than the scheduler hands out: the step graphs' padding rows write there.
        k_shape, v_shape, s_shape = kv_cache_shapes(num_blocks + 1, block_size, a0.num_kv_heads, a0.head_dim,
                                                   self.cache_dtype)
        # One allocation for all layers, touched once here (prefault_kv_cache).
        self.kv_cache = torch.empty(2, len(attn_layers), num_blocks + 1, a0.num_kv_heads, block_size, a0.head_dim,
                                    dtype=self.cache_dtype)
        prefault_kv_cache(self.kv_cache)
        self.kv_scales: torch.Tensor | None = None
        if self.cache_dtype == torch.int8:
            # NOTE: zeros, not empty: the PyTorch decode path gathers padding slots (masked out),
            # and a garbage NaN scale would turn 0-weight * NaN into NaN. It is 1/head_dim of the cache.
            self.kv_scales = torch.zeros(2, len(attn_layers), *s_shape, dtype=KV_SCALE_DTYPE)
        for i, attn in enumerate(attn_layers):
            attn.k_cache = self.kv_cache[0, i].view(k_shape)
            attn.v_cache = self.kv_cache[1, i].view(v_shape)
            attn.k_scale = None if self.kv_scales is None else self.kv_scales[0, i]
            attn.v_scale = None if self.kv_scales is None else self.kv_scales[1, i]
            attn.enable_key_smoothing(self.cache_dtype == torch.int8)
        # NOTE: the kernel path covers every dtype this runner allocates; ARMSERVE_ISA=torch
        # switches to the PyTorch path (the reference the kernels are tested against).
        self.use_kernels = kernels.use_kernel("attention", dtype, head_dim=a0.head_dim)
        # Decode steps replayed from recorded kernel calls (step_graph.py); block tables wide
        # enough for the longest sequence.
        self.graphs = StepGraphs(model, min(max_blocks, num_blocks), block_size,
                                 enabled=self.use_kernels and not enforce_eager, pad_block=num_blocks)

    def _allocate_latent(self, attn_layers: list, num_blocks: int) -> None:
        """MLA's cache: one row of latent + rotary key per token per layer (layers/mla.py)."""
        width = attn_layers[0].latent_dim
        self.kv_cache = torch.empty(len(attn_layers), num_blocks + 1, self.block_size, width, dtype=self.cache_dtype)
        prefault_kv_cache(self.kv_cache)
        self.kv_scales = None
        if self.cache_dtype == torch.int8:  # zeros: see the NOTE in __init__
            self.kv_scales = torch.zeros(len(attn_layers), num_blocks + 1, self.block_size, 2, dtype=KV_SCALE_DTYPE)
        for i, attn in enumerate(attn_layers):
            attn.kv_cache = self.kv_cache[i]
            attn.kv_scale = None if self.kv_scales is None else self.kv_scales[i]

    # ---- input preparation ------------------------------------------------------------------

    def _lora_slots(self, out: SchedulerOutput) -> list[int] | None:
        """Each scheduled request's adapter slot (-1: the base), its adapter loaded into the slot;
        None when no request of the step has one (the layers then skip LoRA altogether)."""
        if self.lora is None:
            return None
        reqs = [s.request.lora_request for s in out.scheduled]
        if all(r is None for r in reqs):
            return None
        slots = self.lora.slots_for(reqs)
        return [-1 if r is None else slots[r.lora_int_id] for r in reqs]

    def _prepare(self, out: SchedulerOutput):
        """Order rows decodes-first and build ids, positions and attention metadata."""
        bs = self.block_size
        decodes = [i for i, s in enumerate(out.scheduled) if s.num_new_tokens == 1]
        prefills = [i for i, s in enumerate(out.scheduled) if s.num_new_tokens > 1]
        order = decodes + prefills
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        row_end: list[int] = [0] * len(out.scheduled)  # last row of each scheduled request
        chunk_meta = []
        for i in order:
            s = out.scheduled[i]
            req = s.request
            start = req.num_computed_tokens
            end = start + s.num_new_tokens
            q_start = len(ids)
            ids.extend(req.all_token_ids[start:end])
            if s.spec_token_ids:
                ids.extend(s.spec_token_ids)  # (past the known tokens: drafts, verified this step)
            pos.extend(range(start, end))
            blocks = s.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            row_end[i] = len(ids) - 1
            if s.num_new_tokens > 1:
                chunk_meta.append((q_start, s.num_new_tokens, start, end, blocks))
        input_ids = torch.tensor(ids, dtype=torch.long)
        positions = torch.tensor(pos, dtype=torch.long)
        md = AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.long), num_decodes=len(decodes))
        if self.use_kernels:
            md.kernel_batch = self._kernel_batch(out, order)
            return input_ids, positions, md, row_end, order
        if decodes:
            ctx = [out.scheduled[i].request.num_computed_tokens + 1 for i in decodes]
            max_ctx = max(ctx)
            blocks = torch.zeros(len(decodes), -(-max_ctx // bs), dtype=torch.long)
            for r, i in enumerate(decodes):
                b = out.scheduled[i].block_ids[: -(-ctx[r] // bs)]
                blocks[r, : len(b)] = torch.tensor(b, dtype=torch.long)
            offs = torch.arange(max_ctx)
            md.decode_slots = blocks[:, offs // bs] * bs + offs % bs
            md.decode_context_lens = torch.tensor(ctx, dtype=torch.long)
        for q_start, q_len, start, end, blocks in chunk_meta:
            p = torch.arange(end)
            bt = torch.tensor(blocks[: -(-end // bs)], dtype=torch.long)
            md.prefills.append(
                PrefillChunk(
                    q_start=q_start,
                    q_len=q_len,
                    context_len=end,
                    slots=bt[p // bs] * bs + p % bs,
                    positions=positions[q_start:q_start + q_len],
                    fresh=start == 0,
                )
            )
        return input_ids, positions, md, row_end, order

    def _kernel_batch(self, out: SchedulerOutput, order: list[int]):
        """int32 step layout for the C++ attention kernel (rows in `order`)."""
        q_start, q_len, ctx = [], [], []
        row = 0
        max_blocks = 1
        for i in order:
            s = out.scheduled[i]
            q_start.append(row)
            q_len.append(s.num_new_tokens)
            ctx.append(s.request.num_computed_tokens + s.num_new_tokens)
            row += s.num_new_tokens
            max_blocks = max(max_blocks, -(-ctx[-1] // self.block_size))
        tables = torch.zeros(len(order), max_blocks, dtype=torch.int32)
        for r, i in enumerate(order):
            b = out.scheduled[i].block_ids[: -(-ctx[r] // self.block_size)]
            tables[r, : len(b)] = torch.tensor(b, dtype=torch.int32)
        tensors = (
            torch.tensor(q_start, dtype=torch.int32),
            torch.tensor(q_len, dtype=torch.int32),
            torch.tensor(ctx, dtype=torch.int32),
            tables,
        )
        batch = kernels.make_attn_batch(*tensors, self.block_size)
        batch._keepalive = tensors  # the struct holds raw pointers into these
        return batch

    # ---- one step ----------------------------------------------------------------------------

    def _graph_logits(self, out: SchedulerOutput, lora_slots: list[int] | None) -> torch.Tensor | None:
        """Logits of a step of decodes only (one token per request, each sampled, no prompt
        logprobs) from a step graph; None when the step must run eagerly."""
        if not (self.use_kernels and self.graphs.enabled) or graph_batch(len(out.scheduled)) > MAX_GRAPH_BATCH:
            return None
        ids, positions, blocks = [], [], []
        for s in out.scheduled:
            req = s.request
            if s.num_new_tokens != 1 or not s.samples or (
                    req.params.prompt_logprobs is not None and req.num_computed_tokens < req.num_prompt_tokens):
                return None
            ids.append(req.all_token_ids[req.num_computed_tokens])
            positions.append(req.num_computed_tokens)
            blocks.append(s.block_ids)
        return self.graphs.run(ids, positions, blocks, lora_slots)

    def _verify_graph_logits(self, out: SchedulerOutput) -> tuple[torch.Tensor, int] | None:
        """(logits, rows per sequence q) of a step of decodes and draft verifications from a step
        graph (sequence i's row j: logits row i * q + j); None when it must run eagerly."""
        if not (self.use_kernels and self.graphs.enabled) or self.tp_workers is not None:
            return None
        tokens, starts, blocks = [], [], []
        for s in out.scheduled:
            req = s.request
            start = req.num_computed_tokens
            if start + 1 != req.num_tokens or not s.samples or (
                    req.params.prompt_logprobs is not None and start < req.num_prompt_tokens):
                return None
            tokens.append([req.all_token_ids[start], *s.spec_token_ids])
            starts.append(start)
            blocks.append(s.block_ids)
        return self.graphs.run_verify(tokens, starts, blocks)

    @torch.inference_mode()
    def capture_verify_graphs(self, max_rows: int) -> None:
        """Record the step graphs of one sequence verifying 1..max_rows - 1 drafts now (warm-up),
        on dummy tokens whose keys and values go to the spare block, rather than on first use."""
        if not (self.use_kernels and self.graphs.enabled) or self.tp_workers is not None:
            return
        pad = self.graphs.pad_block
        for q in range(2, max_rows + 1):
            if pad is None or self.graphs.run_verify([[0] * q], [0], [[pad] * (q // self.block_size + 1)]) is None:
                return  # (graphs off for this model, or q past what a graph takes)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one scheduled step and sample its requests."""
        if self.tp_workers is None:
            return self._execute(out)
        try:
            return self._execute(out)
        except BaseException:
            # the other ranks may wait in a collective this rank will never reach
            self.tp_workers.group.abort()
            raise

    @torch.inference_mode()
    def _execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        sched = out.scheduled
        sample_idx = [i for i, s in enumerate(sched) if s.samples]
        # requests verifying drafts (speculative decoding) apart: they sample k + 1 rows each
        spec_idx = [i for i in sample_idx if sched[i].spec_token_ids]
        plain_idx = [i for i in sample_idx if not sched[i].spec_token_ids] if spec_idx else sample_idx
        # Structured outputs: the constrained rows' bitmask is filled while the model runs.
        grammar_rows = [j for j, i in enumerate(plain_idx) if sched[i].request.grammar is not None]
        bitmask_job = None
        if grammar_rows:
            assert self.structured is not None, "a constrained request reached a runner without a manager"
            bitmask_job = self.structured.fill_bitmask_async(
                [sched[plain_idx[j]].request.grammar for j in grammar_rows])
        lora_slots = self._lora_slots(out)
        graph_logits = self._graph_logits(out, lora_slots)
        verify = self._verify_graph_logits(out) if spec_idx else None
        row_end: list[int] | None = None  # (a graph step has no prompt logprobs)
        if graph_logits is None and verify is None:
            input_ids, positions, md, row_end, order = self._prepare(out)
            lora_indices = None
            if lora_slots is not None:  # one slot per token row, rows in `order`
                lora_indices = torch.tensor([lora_slots[i] for i in order for _ in range(sched[i].num_new_tokens)],
                                            dtype=torch.long)
            if self.tp_workers is not None:
                # the rows compute_logits will see, in the order it will see them (below)
                logit_rows = [[row_end[i] for i in plain_idx] + [
                    r for i in spec_idx for r in range(row_end[i] - len(sched[i].spec_token_ids), row_end[i] + 1)]] + [
                    list(range(lo, hi)) for *_, slices in self._prompt_logprob_chunks(sched, row_end)
                    for lo, hi in slices]
                self.tp_workers.send_step(tp_step_inputs(input_ids, positions, md, logit_rows))
            set_attention_metadata(md)
            set_lora_indices(lora_indices)
            try:
                hidden = self.model(input_ids, positions)
            finally:
                set_attention_metadata(None)
                set_lora_indices(None)

        sampled: list[int | None] = [None] * len(sched)
        logprobs: list[tuple[list[int], list[float], int] | None] = [None] * len(sched)
        accepted: dict[int, list[int]] | None = None
        if spec_idx:
            # One logits row per query token of a request with drafts (row j predicts the token
            # after draft j-1), after the plain requests' rows, all in one compute_logits call.
            if verify is not None:  # (a copy: the graph's logits buffer is rewritten by its next replay)
                graph_rows, q = verify
                rows = [i * q for i in plain_idx]
                for i in spec_idx:
                    rows.extend(range(i * q, i * q + len(sched[i].spec_token_ids) + 1))
                all_logits = graph_rows.index_select(0, torch.tensor(rows, dtype=torch.long))
            else:
                rows = [row_end[i] for i in plain_idx]  # type: ignore[index]
                for i in spec_idx:
                    k = len(sched[i].spec_token_ids)
                    rows.extend(range(row_end[i] - k, row_end[i] + 1))  # type: ignore[index]
                all_logits = self.model.compute_logits(hidden.index_select(0, torch.tensor(rows, dtype=torch.long)))
            spec_reqs = [sched[i].request for i in spec_idx]
            verified = rejection_sample(all_logits[len(plain_idx):], spec_reqs,
                                        [sched[i].spec_token_ids for i in spec_idx], self.vocab_size)
            accepted = {}
            base = len(plain_idx)
            for i, (acc, token) in zip(spec_idx, verified):
                accepted[i] = acc
                sampled[i] = token
                k = sched[i].request.params.logprobs
                if k is not None:  # one (token ids, logprobs, rank) per emitted token, from its own row
                    emitted = torch.tensor(acc + [token], dtype=torch.long)
                    lpt = compute_logprobs_tensors(all_logits[base:base + len(emitted)], emitted, k)
                    logprobs[i] = list(zip(lpt.token_ids.tolist(), lpt.logprobs.tolist(),  # type: ignore[call-overload]
                                           lpt.ranks.tolist()))
                base += len(sched[i].spec_token_ids) + 1
            logits = all_logits[:len(plain_idx)]
        elif plain_idx:
            if graph_logits is not None:
                logits = graph_logits  # every request samples, rows in schedule order
            else:
                rows_t = torch.tensor([row_end[i] for i in plain_idx], dtype=torch.long)
                logits = self.model.compute_logits(hidden.index_select(0, rows_t))
        if plain_idx:
            reqs = [sched[i].request for i in plain_idx]
            batch = build_sampling_batch(
                [r.params for r in reqs],
                [r.prompt_token_ids for r in reqs],
                [r.output_token_ids for r in reqs],
                [r.generator for r in reqs],
                self.vocab_size,
            )
            if bitmask_job is not None:
                batch.grammar_bitmask = bitmask_job.result()
                batch.grammar_rows = torch.tensor(grammar_rows, dtype=torch.long)
            so = self.sampler(logits, batch)
            tokens = so.sampled_token_ids.tolist()
            lp = so.logprobs
            if lp is not None:
                lp_ids, lp_vals, lp_ranks = lp.token_ids.tolist(), lp.logprobs.tolist(), lp.ranks.tolist()
            for j, i in enumerate(plain_idx):
                sampled[i] = tokens[j]
                k = reqs[j].params.logprobs
                if lp is not None and k is not None:
                    logprobs[i] = (lp_ids[j][: k + 1], lp_vals[j][: k + 1], lp_ranks[j])

        prompt_logprobs: dict[str, LogprobsTensors] = {}
        for req, start, end, slices in self._prompt_logprob_chunks(sched, row_end):
            targets = torch.tensor(req.prompt_token_ids[start + 1:end + 1], dtype=torch.long)
            parts = []
            for lo, hi in slices:
                logits = self.model.compute_logits(hidden[lo:hi])
                a = lo - slices[0][0]
                parts.append(compute_logprobs_tensors(logits, targets[a:a + hi - lo], req.params.prompt_logprobs))
            prompt_logprobs[req.request_id] = LogprobsTensors(
                torch.cat([x.token_ids for x in parts]),
                torch.cat([x.logprobs for x in parts]),
                torch.cat([x.ranks for x in parts]),
            )
        aux = None
        if self.keep_aux:
            aux = self._aux_rows(sched, row_end, verify[1] if verify is not None else None)
        return ModelRunnerOutput(sampled, logprobs, prompt_logprobs, accepted, aux)

    def _aux_rows(self, sched, row_end: list[int] | None, q: int | None) -> torch.Tensor:
        """The model's kept hidden states of every scheduled query row, in schedule order, as one
        new tensor (a graph's buffers are rewritten by its next replay)."""
        if row_end is not None:  # eager: rows in the runner's order, each request's ending at row_end
            parts, rows = self.model.aux_hidden, []
            for i, s in enumerate(sched):
                rows.extend(range(row_end[i] - s.num_new_tokens + 1, row_end[i] + 1))
        else:  # a replayed (or just captured) step: sequence i's rows from i * q (a decode step: q 1)
            parts, q = self.graphs.last.aux, q or 1  # type: ignore[union-attr]
            rows = [i * q + j for i, s in enumerate(sched) for j in range(s.num_new_tokens)]
        idx = torch.tensor(rows, dtype=torch.long)
        return torch.cat([p.index_select(0, idx) for p in parts], dim=1)

    @staticmethod
    def _prompt_logprob_chunks(sched, row_end: list[int] | None):
        """(request, first prompt position, end, hidden-row slices) of each request whose prompt
        logprobs this step computes: the rows of its chunk that predict a prompt token (the last
        prompt row predicts output)."""
        for i, s in enumerate(sched):
            req = s.request
            if req.params.prompt_logprobs is None or req.num_computed_tokens >= req.num_prompt_tokens:
                continue
            start = req.num_computed_tokens
            end = min(start + s.num_new_tokens, req.num_prompt_tokens - 1)
            if end <= start:
                continue
            first_row = row_end[i] - (s.num_new_tokens - 1)
            # NOTE: in slices, so a long chunk never holds [chunk, vocab] logits at once.
            slices = [(first_row + a, first_row + min(a + PROMPT_LOGPROBS_SLICE, end - start))
                      for a in range(0, end - start, PROMPT_LOGPROBS_SLICE)]
            yield req, start, end, slices

    @torch.inference_mode()
    def execute_worker(self, step: TPStepInputs) -> None:
        """A tensor-parallel rank > 0: run the step rank 0 sent (its forward and compute_logits
        calls, whose collectives pair with rank 0's); rank 0 samples."""
        input_ids, positions = torch.from_numpy(step.input_ids), torch.from_numpy(step.positions)
        if step.kernel is not None:
            slots, num_decodes, *tensors = step.kernel
            md = AttentionMetadata(slot_mapping=torch.from_numpy(slots), num_decodes=num_decodes)
            tensors = tuple(torch.from_numpy(t) for t in tensors)
            md.kernel_batch = kernels.make_attn_batch(*tensors, self.block_size)
            md.kernel_batch._keepalive = tensors
        else:
            md = step.metadata
        set_attention_metadata(md)
        try:
            hidden = self.model(input_ids, positions)
        finally:
            set_attention_metadata(None)
        for rows in step.logit_rows:
            if rows:
                self.model.compute_logits(hidden[rows])
