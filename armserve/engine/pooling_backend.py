"""The pooling backend: an encoder (models/bert.py) or a decoder run without its LM head
(models/adapters.py) behind the same scheduler and token budget as generation, one vector (or a
classifier's scores) per request. engine/backend.py's interface, so the engine,
the engine-core process and the server carry pooling requests as they carry the others.

    step(): scheduler.schedule()          whole requests only (chunked_prefill=False), up to
                                          max_num_batched_tokens and max_num_seqs per step
            model(ids, positions, lens)   every scheduled sequence in one forward, no KV cache
            pool + normalize / cut        layers/pooler.py, as the checkpoint's
                                          sentence-transformers files say (model_loader/pooling.py)
            finish each request           one SequenceOutput with its vector, finish_reason "stop"

NOTE: the scheduler counts KV blocks; here they only mirror the step's tokens (nothing is cached),
so the block pool is sized to never run out and prefix caching is off.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Sequence

import torch

from armserve import model_loader
from armserve.config import ConfigError, EngineConfig
from armserve.dtypes import resolve_dtypes
from armserve.engine.backend import BackendOutput, SequenceOutput
from armserve.engine.input_processor import EngineCoreRequest
from armserve.engine.kv_cache_manager import KVCacheManager
from armserve.engine.request import Request, RequestStatus
from armserve.engine.scheduler import Scheduler
from armserve.engine.stats import SchedulerStats
from armserve.memory import keep_freed_memory
from armserve.layers.pooler import classify_probs, finish, pool
from armserve.model_loader.pooling import pooler_config, sentence_max_len
from armserve.model_loader import gguf
from armserve.models import get_model_class
from armserve.models.adapters import as_pooling_model
from armserve.pooling_params import PoolingParams
from armserve.sampling_params import SamplingParams

logger = logging.getLogger("armserve")


class PoolingBackend:
    """Owns an encoder model and a scheduler. Not thread-safe: one thread calls every method."""

    structured = None  # no grammars: nothing is generated
    num_kv_blocks = 0  # no KV cache
    kv_block_size = 0

    def __init__(self, config: EngineConfig) -> None:
        from armserve.cpu import init_threads

        t0 = time.time()
        self.config = config
        if config.tensor_parallel_size > 1:
            raise ConfigError("the pooling runner runs on one rank: use tensor_parallel_size 1")
        torch.manual_seed(config.seed)
        src = model_loader.resolve_model_path(config.model)
        hf = model_loader.load_config(src, config.hf_overrides)
        cls = pooling_class(hf)
        # the length the model was trained to embed (sentence_bert_config.json), unless asked for more
        positions = hf.max_position_embeddings - ((hf.pad_token_id + 1) if cls.position_offset_from_pad else 0)
        if config.max_model_len is None:
            config.max_model_len = min(positions, sentence_max_len(src) or positions)
        config.finalize(positions)
        self.max_model_len: int = config.max_model_len  # type: ignore[assignment]
        # A request runs whole in one step: the budget holds at least the longest one.
        self.budget = max(config.max_num_batched_tokens or 0, self.max_model_len)  # type: ignore[arg-type]
        threads = init_threads()
        keep_freed_memory()  # (each layer's activations, freed and allocated again: memory.py)
        self.tokenizer = model_loader.load_tokenizer(src, config.tokenizer)
        if getattr(hf, "classifier_from_token", None):
            hf.classifier_token_ids = _token_ids(self.tokenizer, hf.classifier_from_token)
        self.dtype, _ = resolve_dtypes(config, model_loader.checkpoint_dtype(hf), src.is_gguf)
        self.model = model_loader.load_model(src, hf, self.dtype, config.quantization, model_class=cls,
                                             share_weights=bool(config.share_weights))
        self.pooler = replace(pooler_config(src, hf, cls.default_pooling_type, cls.pooling_task),
                              use_sep_token=cls.uses_sep_token,
                              score_template=config.chat_template or getattr(hf, "rerank_template", None))
        self.model.sep_token_id = self.tokenizer.sep_token_id  # pairs' token types (models/bert.py)
        self.vocab_size = hf.vocab_size
        self.eos_token_ids: set[int] = set()
        bs = config.block_size
        self.kv = KVCacheManager(-(-self.budget // bs) + config.max_num_seqs, bs, enable_caching=False)
        self.scheduler = Scheduler(self.kv, self.budget, config.max_num_seqs, self.max_model_len,
                                   chunked_prefill=False)
        self._params: dict[str, PoolingParams] = {}
        logger.info("loaded %s (%s, pooling %s%s) in %.1fs: dtype %s, max_model_len %d, %d tokens per step, "
                    "%d threads", config.model, hf.architectures[0], self.pooler.pooling_type,
                    " + normalize" if self.pooler.normalize else "", time.time() - t0,
                    str(self.dtype).replace("torch.", ""), self.max_model_len, self.budget, threads["threads"])

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a pooling request (ValueError for a generation request or bad `dimensions`)."""
        params = request.pooling
        if params is None:
            raise ValueError("this model is an embedding model (runner pooling): it pools inputs into vectors or "
                             "scores and cannot generate text")
        self.pooler.check_dimensions(params.dimensions)
        self._params[request.request_id] = params
        self.scheduler.add_request(Request(request.request_id, request.prompt_token_ids, request.params, 1,
                                           request.arrival_time))

    def abort_request(self, request_id: str, indices: Sequence[int] | None = None) -> None:
        if self._params.pop(request_id, None) is not None:
            self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return bool(self._params)

    @torch.inference_mode()
    def step(self) -> BackendOutput:
        """Encode and pool every request the scheduler admits this step; each one finishes."""
        out = BackendOutput()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return out
        reqs = [s.request for s in sched.scheduled]
        lens = [r.num_tokens for r in reqs]
        ids = torch.tensor([t for r in reqs for t in r.all_token_ids], dtype=torch.long)
        positions = torch.cat([torch.arange(n) for n in lens])
        hidden = self.model(ids, positions, lens)
        classify = self.pooler.task == "classify"
        pooled = classify_probs(self.model.classify(hidden, lens)) if classify else \
            pool(hidden, lens, self.pooler.pooling_type)
        for r, vec in zip(reqs, pooled):
            rid = r.request_id
            p = self._params.pop(rid)
            if not classify:
                vec = finish(vec, self.pooler.normalize if p.normalize is None else p.normalize, p.dimensions)
            self.scheduler.finish_request(rid, RequestStatus.FINISHED_STOPPED)
            out.scheduled[rid] = 0
            out.sequences.append(SequenceOutput(rid, 0, [], finish_reason="stop", pooled=vec.clone()))
        out.num_prompt_tokens = sum(lens)
        return out

    def warm_up(self) -> None:
        """One full-budget step of dummy inputs (the memory a large step touches, paid now)."""
        # (the configured step size: a decoder's max_model_len may be tens of thousands of tokens)
        n = min(self.config.max_num_batched_tokens or self.budget, self.max_model_len)
        ids = [1 + i % (self.vocab_size - 1) for i in range(n)]
        sp = SamplingParams(max_tokens=1)
        self.add_request(EngineCoreRequest("armserve-warm-up", None, ids, sp, 1, time.time(), [sp], PoolingParams()))
        while self.has_unfinished_requests():
            self.step()

    def release_idle_memory(self) -> None:
        """Nothing beside the heap (an encoder step's activations are freed into it)."""

    def scheduler_stats(self) -> SchedulerStats:
        return SchedulerStats(num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting)


def _token_ids(tokenizer, tokens: list[str]) -> list[int]:
    """Vocabulary ids of `classifier_from_token` (each one token of the model's vocabulary)."""
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise ConfigError(f"classifier_from_token must be a list of tokens, got {tokens!r}")
    ids = []
    for t in tokens:
        i = tokenizer.convert_tokens_to_ids(t)
        if i is None or i == tokenizer.unk_token_id:
            raise ConfigError(f"classifier_from_token: {t!r} is not a token of this model's vocabulary")
        ids.append(int(i))
    return ids


def pooling_class(hf):
    """The model class the pooling runner builds for `hf`: the family's own pooling class (an
    encoder, a bare decoder, a sequence classifier), else a decoder's, adapted (`--runner pooling`
    on a *ForCausalLM: embeddings of its final hidden states)."""
    cls = get_model_class(hf.architectures[0])
    if getattr(cls, "is_pooling_model", False):
        return cls
    return as_pooling_model(cls, "embed")


def resolve_runner(config: EngineConfig) -> str:
    """"generate" or "pooling" for `config.runner` ("auto": pooling for a family that only pools,
    its class's `is_pooling_model`, or a GGUF whose header names a pooling type); a ConfigError
    when the model cannot run as asked."""
    if config.runner == "generate" or (config.runner == "auto" and config.backend != "torch"):
        return "generate"
    src = model_loader.resolve_model_path(config.model)
    if src.is_gguf:
        # (the header's metadata only: the whole parse, vocabulary and all, costs seconds)
        pools = gguf.pooling_type(src) is not None
    else:
        hf = model_loader.load_config(src, config.hf_overrides)
        cls = get_model_class(hf.architectures[0])
        pools = bool(getattr(cls, "is_pooling_model", False))
        # (a decoder family the adapter takes declares `has_lm_head`: models/adapters.py)
        if config.runner == "pooling" and not pools and not hasattr(cls, "has_lm_head"):
            raise ConfigError(f"runner 'pooling' is not supported for {hf.architectures[0]}")
    if config.runner == "auto":
        return "pooling" if pools else "generate"
    if config.backend != "torch":
        raise ConfigError("runner 'pooling' runs on the torch backend only")
    return "pooling"
