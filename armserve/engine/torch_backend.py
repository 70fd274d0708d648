"""The torch backend: armserve's own model, paged KV cache and scheduler behind token ids
(engine/backend.py); `step()` = schedule -> execute -> sample -> update the scheduler.

A request's n completions are n sequences (`Request`s, ids `i_<request id>` when n > 1), each with
its KV blocks; the engine's output processor turns their tokens into text and outputs.
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import Sequence

import torch

from armserve.config import ConfigError, EngineConfig
from armserve.dtypes import resolve_dtypes
from armserve.engine.backend import BackendOutput, SequenceOutput, run_dummy_request
from armserve.engine.input_processor import EngineCoreRequest
from armserve.engine.kv_cache_manager import KVCacheManager
from armserve.engine.memory_plan import plan_memory
from armserve.engine.model_runner import ModelRunner, kv_cache_bytes_per_token, kv_cache_num_blocks
from armserve.engine.request import Request, RequestStatus
from armserve.engine.scheduler import Scheduler
from armserve.engine.draft_proposer import DraftModelProposer, load_draft_model
from armserve.layers.rotary_embedding import trim_rope_tables
from armserve.engine.eagle_proposer import EagleProposer
from armserve.engine.spec_decode import NgramProposer
from armserve.engine.suffix_decode import SuffixProposer
from armserve.engine.stats import SchedulerStats
from armserve.engine.structured_output import StructuredOutputManager
from armserve.layers.linear import ParallelContext
from armserve import model_loader

logger = logging.getLogger("armserve")


class TorchBackend:
    """Owns the model, the KV cache and the scheduler. Not thread-safe: one thread calls
    `add_request`, `abort_request` and `step`."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        t0 = time.time()
        from armserve.cpu import init_threads

        torch.manual_seed(config.seed)
        src = model_loader.resolve_model_path(config.model)
        self.model_config = model_loader.load_config(src, config.hf_overrides)
        hf = self.model_config
        config.finalize(getattr(hf, "max_position_embeddings", None) or 2048)
        self.max_model_len: int = config.max_model_len  # type: ignore[assignment]
        tp = config.tensor_parallel_size
        self.tp_workers = None
        parallel = None  # one rank: the whole model
        if tp > 1:
            # Ranks 1..tp-1 start loading their parts now, while this process (rank 0) loads its own.
            from armserve.cpu import core_groups
            from armserve.distributed import TPWorkers, make_comm_spec

            binds = core_groups(tp)
            hidden = hf.hidden_size
            slot = max(config.max_num_batched_tokens * hidden * 4, 8 * 4 * -(-hf.vocab_size // tp))
            comm = make_comm_spec(tp, slot)
            self.tp_workers = TPWorkers(config, comm, binds)  # before this process binds its own threads
            threads = init_threads(bind=binds[0])
        else:
            threads = init_threads()
        try:
            if self.tp_workers is not None:
                parallel = ParallelContext(0, tp, comm.join(0))
            self.tokenizer = model_loader.load_tokenizer(src, config.tokenizer)
            if config.chat_template:
                self.tokenizer.chat_template = config.chat_template
            self.eos_token_ids = model_loader.eos_token_ids(src, self.tokenizer)
            self.dtype, self.kv_cache_dtype = resolve_dtypes(config, model_loader.checkpoint_dtype(hf), src.is_gguf)
            # (before any weight is read: a plan that does not fit fails in seconds, not after loading)
            self.memory_plan = plan_memory(config, src, hf, self.dtype, self.kv_cache_dtype)
            logger.info("memory plan of %s:\n  %s", config.model, "\n  ".join(self.memory_plan.lines()))
            self.model = model_loader.load_model(src, hf, self.dtype, config.quantization, parallel,
                                                 share_weights=bool(config.share_weights))
        except BaseException:
            if self.tp_workers is not None:
                self.tp_workers.close()
            raise

        spec = config.speculative_config
        draft = draft_config = None
        if spec is not None and spec.method == "draft_model":  # type: ignore[union-attr]
            # (a draft head over part of the vocabulary keeps every special token: end of turn above all)
            special = set(self.tokenizer.added_tokens_decoder) | self.eos_token_ids
            draft, draft_config = load_draft_model(spec, hf, self.dtype, special)  # type: ignore[arg-type]
        elif spec is not None and spec.method == "eagle3":  # type: ignore[union-attr]
            from armserve.models.eagle3 import load_eagle3_head

            # (the target now keeps the hidden states the head reads)
            draft, draft_config = load_eagle3_head(spec.model, self.model, hf, self.dtype)  # type: ignore
        elif spec is not None and spec.method == "mtp":  # type: ignore[union-attr]
            from armserve.models.deepseek_mtp import load_mtp_layer

            draft, draft_config = load_mtp_layer(spec.model or config.model, self.model, hf, self.dtype)  # type: ignore
        # Rotary tables for the positions this engine can reach, not the model's whole context.
        for m in (self.model, draft):
            if m is not None:
                trim_rope_tables(m, config.positions_reached())
        # (under tensor parallelism each rank caches only its share of the KV heads; a draft model's
        # cache shares the space, block for block)
        num_blocks = kv_cache_num_blocks(hf, config.kv_cache_space, config.block_size, self.kv_cache_dtype,
                                         config.tensor_parallel_size)
        if draft_config is not None:
            per_token = (kv_cache_bytes_per_token(hf, self.kv_cache_dtype)
                         + kv_cache_bytes_per_token(draft_config, self.kv_cache_dtype))
            num_blocks = int(config.kv_cache_space * (1 << 30)) // (config.block_size * per_token)
        if num_blocks < 1:
            raise ConfigError(
                f"kv_cache_space {config.kv_cache_space} GiB holds no block of {config.block_size} tokens "
                "for this model; raise it"
            )
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        proposer = None
        if draft is not None and spec.method in ("eagle3", "mtp"):  # type: ignore[union-attr]
            # (the head's steps run eagerly: its forward takes hidden states besides token ids)
            proposer = EagleProposer(spec, ModelRunner(  # type: ignore[arg-type]
                draft, num_blocks, config.block_size, self.dtype, self.kv_cache_dtype, self.max_model_len, True))
        elif draft is not None:
            proposer = DraftModelProposer(spec, ModelRunner(  # type: ignore[arg-type]
                draft, num_blocks, config.block_size, self.dtype, self.kv_cache_dtype, self.max_model_len,
                config.enforce_eager))
        elif spec is not None and spec.method == "suffix":  # type: ignore[union-attr]
            proposer = SuffixProposer(spec)  # type: ignore[arg-type]
        elif spec is not None:
            proposer = NgramProposer(spec)  # type: ignore[arg-type]
        self.scheduler = Scheduler(
            self.kv, config.max_num_batched_tokens, config.max_num_seqs, self.max_model_len,  # type: ignore[arg-type]
            proposer=proposer, max_loras=config.max_loras if config.enable_lora else None,
        )
        # LoRA: slots of stacked adapter weights in every targeted layer (lora/manager.py)
        self.lora = None
        if config.enable_lora:
            from armserve.lora.manager import LoRAManager

            self.lora = LoRAManager(self.model, self.dtype, config.max_loras, config.max_lora_rank,
                                    config.max_cpu_loras)  # type: ignore[arg-type]
        if self.tp_workers is not None:
            try:
                self.tp_workers.start(parallel.group, num_blocks)
            except BaseException:
                self.tp_workers.close()
                raise
        if self.tp_workers is not None:
            weakref.finalize(self, self.tp_workers.close)  # LLM objects come and go (tests, notebooks)
        self.runner = ModelRunner(self.model, num_blocks, config.block_size, self.dtype, self.kv_cache_dtype,
                                  self.max_model_len, config.enforce_eager, tp_workers=self.tp_workers, lora=self.lora)
        self.vocab_size = hf.vocab_size
        self.num_kv_blocks, self.kv_block_size = num_blocks, config.block_size
        # xgrammar's tokenizer info and compiler are built on the first structured request.
        self.structured = StructuredOutputManager(self.tokenizer, hf.vocab_size, self.eos_token_ids,
                                                  compile_timeout=config.grammar_compile_timeout)
        self.runner.structured = self.structured
        self.eagle = proposer if isinstance(proposer, EagleProposer) else None
        self._requests: dict[str, list[Request]] = {}  # request id -> its sequences, until all have finished
        self._seq_of: dict[str, tuple[str, int]] = {}  # sequence (Request) id -> (request id, index)
        from armserve import kernels

        logger.info(
            "loaded %s (%s) in %.1fs: dtype %s, max_model_len %d, KV cache %s %d blocks x %d tokens = %d tokens "
            "(%.2f GiB, %d bytes per token), kernels %s, %d threads%s",
            config.model, hf.architectures[0], time.time() - t0, str(self.dtype).replace("torch.", ""),
            self.max_model_len, str(self.kv_cache_dtype).replace("torch.", ""), num_blocks, config.block_size,
            num_blocks * config.block_size, config.kv_cache_space,
            kv_cache_bytes_per_token(hf, self.kv_cache_dtype), kernels.isa(),
            threads["threads"], f" pinned to {threads['bind']}" if threads["bind"] else "",
        )

    def warm_up(self) -> None:
        """One full-budget prefill and a decode step on dummy tokens, then forgotten (vLLM's profile
        run does the same at start-up). The first large step of a process pays for the memory its
        activations touch for the first time (~2 ms per MiB on some VMs: ~150 ms of a first
        1k-token prompt); serving starts with that memory already in the allocator's hands. The
        prefix cache and its counters are as before afterwards."""
        kv = self.kv
        saved = (kv.prefix_queries, kv.prefix_hits, self.scheduler.num_preemptions)
        run_dummy_request(self, min(self.config.max_num_batched_tokens, self.max_model_len - 2))  # type: ignore
        kv.prefix_queries, kv.prefix_hits, self.scheduler.num_preemptions = saved
        proposer = self.scheduler.proposer
        if proposer is not None:
            # a lone request's verify steps, one graph per draft length it can reach: captured on
            # first use they cost a suffix-decoding request copying code ~14% of its time
            most = min(getattr(proposer, "max_draft", proposer.k), proposer.config.draft_share(1))
            self.runner.capture_verify_graphs(min(most, self.max_model_len - 1) + 1)
        if self.scheduler.spec_stats is not None:
            self.scheduler.spec_stats = type(self.scheduler.spec_stats).empty(self.scheduler.proposer.k)
        kv.reset_prefix_cache()

    def release_idle_memory(self) -> None:
        """The step graphs' scratch, the target's and a draft model's (StepGraphs.release_scratch),
        and the other tensor-parallel ranks' free heap."""
        self.runner.graphs.release_scratch()
        if self.tp_workers is not None:
            self.tp_workers.trim()
        draft_runner = getattr(self.scheduler.proposer, "runner", None)
        if draft_runner is not None:
            draft_runner.graphs.release_scratch()

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue the request's n sequences (a ValueError naming a bad structured-output spec)."""
        compiled = None
        if request.lora_request is not None:
            if self.lora is None:
                raise ValueError("LoRA is not enabled: start the engine with enable_lora=True (--enable-lora)")
            self.lora.add(request.lora_request)  # LoRAError (ValueError) naming a bad adapter folder
        if request.params.structured_outputs is not None:
            compiled = self.structured.compile(request.params.structured_outputs)  # ValueError naming the problem
        rid, n = request.request_id, request.n
        seqs = []
        for i, params in enumerate(request.seq_params):
            req = Request(rid if n == 1 else f"{i}_{rid}", request.prompt_token_ids, params, request.max_tokens,
                          request.arrival_time, request.lora_request)
            if compiled is not None:
                req.grammar = self.structured.new_matcher(compiled)
            seqs.append(req)
            self._seq_of[req.request_id] = (rid, i)
            self.scheduler.add_request(req)
        self._requests[rid] = seqs

    def abort_request(self, request_id: str, indices: Sequence[int] | None = None) -> None:
        """Stop sequences now and free their KV blocks. Unknown ids are ignored."""
        seqs = self._requests.get(request_id)
        if seqs is None:
            return
        for i in range(len(seqs)) if indices is None else indices:
            self.scheduler.finish_request(seqs[i].request_id, RequestStatus.FINISHED_ABORTED)  # (no-op if finished)
        self._forget_if_done(request_id)

    def _forget_if_done(self, request_id: str) -> None:
        seqs = self._requests[request_id]
        if all(s.is_finished for s in seqs):
            del self._requests[request_id]
            for s in seqs:
                del self._seq_of[s.request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def step(self) -> BackendOutput:
        """Run one iteration: each scheduled sequence's new token (none for a prefill chunk that did
        not reach the end of its prompt)."""
        out = BackendOutput()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return out
        seq_of = self._seq_of
        for s in sched.scheduled:
            rid = seq_of[s.request.request_id][0]
            # (set when the first sequence is first scheduled, which is never after the others)
            out.scheduled[rid] = max(self._requests[rid][0].num_cached_tokens, 0)
        out.preempted = [seq_of[r.request_id][0] for r in sched.preempted]
        out.num_prompt_tokens = sum(
            max(0, min(s.num_new_tokens, s.request.num_prompt_tokens - s.request.num_computed_tokens))
            for s in sched.scheduled
        )

        eagle = self.eagle is not None and sched.speculating
        self.runner.keep_aux = eagle  # (the head needs the target's hidden states of this step)
        result = self.runner.execute(sched)
        starts = [s.request.num_computed_tokens for s in sched.scheduled] if eagle else None
        new_tokens = self.scheduler.update_from_output(sched, result.sampled, result.accepted)
        if starts is not None:
            self.eagle.record(sched, starts, result.aux_hidden)  # type: ignore[union-attr]
        prompt_lp = result.prompt_logprobs
        for child, lpt in prompt_lp.items():
            out.prompt_logprobs[seq_of[child][0]] = (lpt.token_ids.tolist(), lpt.logprobs.tolist(), lpt.ranks.tolist())
        ended = []
        # This loop runs once per step for every scheduled sequence: keep it lean.
        for s, tokens, lp in zip(sched.scheduled, new_tokens, result.logprobs):
            req = s.request
            rid, index = seq_of[req.request_id]
            if tokens is None:
                if prompt_lp:  # (an output goes out with the new prompt logprobs)
                    out.sequences.append(SequenceOutput(rid, index, []))
                continue
            if lp is not None:
                lp = lp[:len(tokens)] if isinstance(lp, list) else [lp]  # (a verified run's: one per token)
            seq = SequenceOutput(rid, index, tokens, lp)
            if req.is_finished:
                seq.finish_reason, seq.stop_reason = req.status.value, req.stop_reason  # type: ignore[assignment]
                ended.append(rid)
            out.sequences.append(seq)
        for rid in ended:
            if rid in self._requests:
                self._forget_if_done(rid)
        return out

    def scheduler_stats(self) -> SchedulerStats:
        """The backend's state now, as the stat loggers receive it."""
        kv = self.kv
        return SchedulerStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=kv.usage,
            kv_blocks_used=kv.num_blocks - kv.num_free_blocks,
            kv_blocks_total=kv.num_blocks,
            prefix_cache_queries=kv.prefix_queries,
            prefix_cache_hits=kv.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions,
            spec_decoding=None if self.scheduler.spec_stats is None else self.scheduler.spec_stats.copy(),
        )
