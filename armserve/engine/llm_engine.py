"""The engine: admit requests, then `step()` = schedule -> execute -> sample -> update outputs."""

from __future__ import annotations

import itertools
import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Container, Iterator, Sequence

import torch

from armserve.prompts import prompt_to_ids
from armserve.config import ConfigError, EngineConfig, resolve_dtype, resolve_kv_cache_dtype
from armserve.engine.detokenizer import IncrementalDetokenizer
from armserve.engine.kv_cache_manager import KVCacheManager
from armserve.engine.model_runner import ModelRunner, kv_cache_bytes_per_token, kv_cache_num_blocks
from armserve.engine.request import Request, RequestStatus
from armserve.engine.scheduler import Scheduler
from armserve.engine.structured_output import StructuredOutputManager
from armserve.layers.linear import ParallelContext
from armserve import model_loader
from armserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from armserve.sampling_params import SamplingParams

logger = logging.getLogger("armserve")

PromptType = str | list[int] | dict[str, Any]


class RequestError(ValueError):
    """A request cannot be served as asked (too long, bad tokens, ...); the engine is unaffected."""


OUTPUT_KINDS = ("final", "cumulative", "delta")


def check_request_args(params: SamplingParams | None, output_kind: str, request_id: str | None,
                       in_use: Container[str], ids: Iterator[int]) -> tuple[SamplingParams, str]:
    """What every backend checks before it tokenizes (RequestError naming the problem): the
    params (None: defaults), `output_kind`, and the request id (None: the next of `ids`)."""
    params = params or SamplingParams()
    if not isinstance(params, SamplingParams):
        raise RequestError(f"sampling params must be SamplingParams, got {type(params).__name__}")
    if output_kind not in OUTPUT_KINDS:
        raise RequestError(f"output_kind must be one of {OUTPUT_KINDS}, got {output_kind!r}")
    request_id = str(next(ids)) if request_id is None else request_id
    if request_id in in_use:
        raise RequestError(f"request id {request_id!r} is already in use")
    return params, request_id


def validate_prompt(ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int, num_blocks: int,
                    block_size: int, sequences: int = 1) -> None:
    """RequestError naming what keeps a prompt from being served: empty, a token outside the
    vocabulary, no room within max_model_len, or more KV cache than the whole cache (for
    `sequences` sequences that each hold their own blocks) at the longest it may grow."""
    if not ids:
        raise RequestError("the prompt is empty")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"prompt token id {bad[0]} is out of range for the vocabulary size {vocab_size}")
    n = len(ids)
    if n >= max_model_len:
        raise RequestError(
            f"the prompt has {n} tokens, which leaves no room to generate within max_model_len {max_model_len}"
        )
    if params.max_tokens is not None and n + params.max_tokens > max_model_len:
        raise RequestError(
            f"the prompt ({n} tokens) plus max_tokens ({params.max_tokens}) is {n + params.max_tokens}, "
            f"more than max_model_len {max_model_len}"
        )
    max_tokens = params.max_tokens if params.max_tokens is not None else max_model_len - n
    total = n + max_tokens
    if -(-total // block_size) * sequences > num_blocks:
        what = f"{sequences} x ({n} prompt + {max_tokens} max_tokens)" if sequences > 1 else \
            f"{n} prompt + {max_tokens} max_tokens"
        raise RequestError(
            f"the request needs up to {what} = {total * sequences} tokens of KV cache, more than the whole cache "
            f"holds ({num_blocks * block_size} tokens); lower {'n or ' if sequences > 1 else ''}max_tokens, or "
            "raise kv_cache_space"
        )


@dataclass
class _Completion:
    """Output-side state of one child sequence."""

    index: int
    request: Request
    detok: IncrementalDetokenizer
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float | None
    sent_tokens: int = 0  # tokens already handed out (delta mode)
    sent_logprobs: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    reported_final: bool = False


@dataclass
class _ParentRequest:
    """A user request: one prompt, `n` completions."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_kind: str
    metrics: RequestMetrics
    completions: list[_Completion] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)


class LLMEngine:
    """Owns the model, the KV cache, the scheduler and every request's output state.

    Not thread-safe: one thread calls `add_request`, `abort_request` and `step`.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        t0 = time.time()
        from armserve.cpu import init_threads

        torch.manual_seed(config.seed)
        src = model_loader.resolve_model_path(config.model)
        self.model_config = model_loader.load_config(src)
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
            self.dtype = resolve_dtype(config.dtype, model_loader.checkpoint_dtype(hf))
            self.model = model_loader.load_model(src, hf, self.dtype, config.quantization, parallel)
        except BaseException:
            if self.tp_workers is not None:
                self.tp_workers.close()
            raise

        self.kv_cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        # (under tensor parallelism each rank caches only its share of the KV heads)
        num_blocks = kv_cache_num_blocks(hf, config.kv_cache_space, config.block_size, self.kv_cache_dtype,
                                         config.tensor_parallel_size)
        if num_blocks < 1:
            raise ConfigError(
                f"kv_cache_space {config.kv_cache_space} GiB holds no block of {config.block_size} tokens "
                "for this model; raise it"
            )
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.kv, config.max_num_batched_tokens, config.max_num_seqs, self.max_model_len  # type: ignore[arg-type]
        )
        if self.tp_workers is not None:
            try:
                self.tp_workers.start(parallel.group, num_blocks)
            except BaseException:
                self.tp_workers.close()
                raise
        if self.tp_workers is not None:
            weakref.finalize(self, self.tp_workers.close)  # LLM objects come and go (tests, notebooks)
        self.runner = ModelRunner(self.model, num_blocks, config.block_size, self.dtype, self.kv_cache_dtype,
                                  self.max_model_len, config.enforce_eager, tp_workers=self.tp_workers)
        self.eos_token_ids = model_loader.eos_token_ids(src, self.tokenizer)
        self.vocab_size = hf.vocab_size
        # xgrammar's tokenizer info and compiler are built on the first structured request.
        self.structured = StructuredOutputManager(self.tokenizer, hf.vocab_size, self.eos_token_ids,
                                                  compile_timeout=config.grammar_compile_timeout)
        self.runner.structured = self.structured
        self._parents: dict[str, _ParentRequest] = {}
        self._child_to_parent: dict[str, tuple[_ParentRequest, _Completion]] = {}
        self._ids = itertools.count()
        # Counters for stats and metrics.
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0
        self.num_requests_finished = 0
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
        """Run one full-budget prefill and a decode step on dummy tokens, then forget them (vLLM's
        profile run does the same at start-up). The first large step of a process pays for the
        memory its activations touch for the first time (~2 ms per MiB on some VMs: ~150 ms of a
        first 1k-token prompt); serving starts with that memory already in the allocator's hands.
        Counters, metrics and the prefix cache are as before afterwards."""
        n = min(self.config.max_num_batched_tokens, self.max_model_len - 2)  # type: ignore[type-var]
        if n < 1:
            return
        vocab = self.model_config.vocab_size
        saved = (self.num_prompt_tokens_total, self.num_generation_tokens_total, self.num_requests_finished,
                 self.kv.prefix_queries, self.kv.prefix_hits, self.scheduler.num_preemptions)
        rid = self.add_request("armserve-warm-up", {"prompt_token_ids": [1 + i % (vocab - 1) for i in range(n)]},
                               SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        while rid in self._parents:
            self.step()
        (self.num_prompt_tokens_total, self.num_generation_tokens_total, self.num_requests_finished,
         self.kv.prefix_queries, self.kv.prefix_hits, self.scheduler.num_preemptions) = saved
        self.kv.reset_prefix_cache()

    # ---- admission --------------------------------------------------------------------------

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        return prompt_to_ids(self.tokenizer, prompt)

    def add_request(
        self,
        request_id: str | None,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        output_kind: str = "final",
    ) -> str:
        """Validate and queue a request; raises `RequestError`/`ValueError` naming the problem,
        leaving the engine untouched."""
        params, request_id = check_request_args(params, output_kind, request_id, self._parents, self._ids)
        text, ids = self.tokenize_prompt(prompt)
        # NOTE: all n completions counted: a request whose children could never all be in the cache
        # at once would run them a few at a time, holding the engine for many times its length.
        validate_prompt(ids, params, self.model_config.vocab_size, self.max_model_len, self.kv.num_blocks,
                        self.kv.block_size, params.n)
        compiled = None
        if params.structured_outputs is not None:
            compiled = self.structured.compile(params.structured_outputs)  # ValueError naming the problem
        max_tokens = self.max_model_len - len(ids)
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)

        now = arrival_time if arrival_time is not None else time.time()
        parent = _ParentRequest(request_id, text, ids, output_kind, RequestMetrics(arrival_time=now))
        for i in range(params.n):
            child_params = params if params.n == 1 else params.clone(
                n=1,
                seed=None if params.seed is None else params.seed + i,
                prompt_logprobs=params.prompt_logprobs if i == 0 else None,
            )
            child_params.update_from_generation_config(self.eos_token_ids)
            child_id = request_id if params.n == 1 else f"{i}_{request_id}"
            req = Request(child_id, ids, child_params, max_tokens, now)
            if compiled is not None:
                req.grammar = self.structured.new_matcher(compiled)
            comp = _Completion(
                index=i,
                request=req,
                detok=IncrementalDetokenizer(self.tokenizer, ids, child_params),
                logprobs=[] if child_params.logprobs is not None else None,
                cumulative_logprob=0.0 if child_params.logprobs is not None else None,
            )
            parent.completions.append(comp)
            self._child_to_parent[child_id] = (parent, comp)
            self.scheduler.add_request(req)
        if params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None]
        self._parents[request_id] = parent
        return request_id

    def abort_request(self, request_ids: str | Sequence[str]) -> None:
        """Stop requests now and free their KV blocks. Unknown ids are ignored."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            parent = self._parents.pop(rid, None)
            if parent is None:
                continue
            for c in parent.completions:
                self.scheduler.finish_request(c.request.request_id, RequestStatus.FINISHED_ABORTED)
                self._child_to_parent.pop(c.request.request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._parents)

    # ---- one step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one engine iteration and return outputs of requests that progressed (per their
        output kind)."""
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        now = time.time()
        for s in sched.scheduled:
            parent, _ = self._child_to_parent[s.request.request_id]
            if parent.metrics.first_scheduled_time is None:
                parent.metrics.first_scheduled_time = now
        for r in sched.preempted:
            self._child_to_parent[r.request_id][0].metrics.num_preemptions += 1
        num_prompt = sum(
            max(0, min(s.num_new_tokens, s.request.num_prompt_tokens - s.request.num_computed_tokens))
            for s in sched.scheduled
        )

        result = self.runner.execute(sched)
        prompt_lp = result.prompt_logprobs
        self.scheduler.update_from_output(sched, result.sampled)
        self.num_prompt_tokens_total += num_prompt

        now = time.time()
        touched: dict[str, _ParentRequest] = {}
        for s, token, lp in zip(sched.scheduled, result.sampled, result.logprobs):
            req = s.request
            parent, comp = self._child_to_parent[req.request_id]
            if req.request_id in prompt_lp:
                self._add_prompt_logprobs(parent, prompt_lp[req.request_id])
            if token is None:
                if prompt_lp:
                    touched[parent.request_id] = parent
                continue
            self.num_generation_tokens_total += 1
            touched[parent.request_id] = parent
            if parent.metrics.first_token_time is None:
                parent.metrics.first_token_time = now
            parent.metrics.last_token_time = now
            if lp is not None:
                self._add_logprobs(comp, lp)
            stop_terminated = req.status == RequestStatus.FINISHED_STOPPED
            stop_str = comp.detok.update([token], stop_terminated)
            if stop_str is not None:
                if not req.is_finished:
                    self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
                req.status = RequestStatus.FINISHED_STOPPED
                req.stop_reason = stop_str
            if req.is_finished:
                comp.finish_reason = req.status.value
                comp.stop_reason = req.stop_reason

        outputs: list[RequestOutput] = []
        for parent in touched.values():
            finished = parent.finished
            if finished:
                parent.metrics.finished_time = now
                self._parents.pop(parent.request_id, None)
                for c in parent.completions:
                    self._child_to_parent.pop(c.request.request_id, None)
                self.num_requests_finished += 1
            if parent.output_kind == "final" and not finished:
                continue
            outputs.append(self._make_output(parent, finished))
        return outputs

    def _add_logprobs(self, comp: _Completion, lp: tuple[list[int], list[float], int]) -> None:
        ids, vals, rank = lp
        pos: dict[int, Logprob] = {}
        dec = comp.detok.decode_token
        pos[ids[0]] = Logprob(vals[0], rank, dec(ids[0]))
        for r, (t, v) in enumerate(zip(ids[1:], vals[1:]), start=1):
            if t not in pos:
                pos[t] = Logprob(v, r, dec(t))
        comp.logprobs.append(pos)  # type: ignore[union-attr]
        comp.cumulative_logprob += vals[0]  # type: ignore[operator]

    def _add_prompt_logprobs(self, parent: _ParentRequest, lpt) -> None:
        dec = parent.completions[0].detok.decode_token
        ids, vals, ranks = lpt.token_ids.tolist(), lpt.logprobs.tolist(), lpt.ranks.tolist()
        for row_ids, row_vals, rank in zip(ids, vals, ranks):
            pos = {row_ids[0]: Logprob(row_vals[0], rank, dec(row_ids[0]))}
            for r, (t, v) in enumerate(zip(row_ids[1:], row_vals[1:]), start=1):
                pos.setdefault(t, Logprob(v, r, dec(t)))
            parent.prompt_logprobs.append(pos)  # type: ignore[union-attr]

    def _make_output(self, parent: _ParentRequest, finished: bool) -> RequestOutput:
        delta = parent.output_kind == "delta"
        comps: list[CompletionOutput] = []
        for c in parent.completions:
            req = c.request
            if delta:
                if c.reported_final:
                    continue
                toks = req.output_token_ids[c.sent_tokens:]
                lps = c.logprobs[c.sent_logprobs:] if c.logprobs is not None else None
                if not toks and c.finish_reason is None:
                    continue
                text = c.detok.get_next_output_text(c.finish_reason is not None, delta=True)
                c.sent_tokens = req.num_output_tokens
                c.sent_logprobs = len(c.logprobs) if c.logprobs is not None else 0
            else:
                toks = list(req.output_token_ids)
                lps = list(c.logprobs) if c.logprobs is not None else None
                text = c.detok.get_next_output_text(c.finish_reason is not None, delta=False)
            if c.finish_reason is not None:
                c.reported_final = True
            comps.append(
                CompletionOutput(
                    index=c.index,
                    text=text,
                    token_ids=list(toks),
                    cumulative_logprob=c.cumulative_logprob,
                    logprobs=lps,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
            )
        first = parent.completions[0].request
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            prompt_logprobs=parent.prompt_logprobs,
            outputs=comps,
            finished=finished,
            metrics=parent.metrics,
            num_cached_tokens=max(first.num_cached_tokens, 0),
        )

    # ---- introspection ----------------------------------------------------------------------

    def scheduler_stats(self):
        """The engine's state now, as the stat loggers receive it (engine/core.py: SchedulerStats)."""
        from armserve.engine.stats import SchedulerStats

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
        )

    def stats(self) -> dict[str, float]:
        return {
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "kv_cache_usage": self.kv.usage,
            "prefix_cache_hit_rate": self.kv.prefix_hit_rate,
            "prefix_cache_queries": self.kv.prefix_queries,
            "prefix_cache_hits": self.kv.prefix_hits,
            "num_preemptions": self.scheduler.num_preemptions,
            "prompt_tokens_total": self.num_prompt_tokens_total,
            "generation_tokens_total": self.num_generation_tokens_total,
        }
