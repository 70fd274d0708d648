"""The engine: input processor -> backend -> output processor, the one thing `LLM` drives. The
engine core (engine/core.py) drives the backend alone, with this file's `input_processor_for`,
`check_request` and `lora_manager`: the server's front end (engine/async_llm.py) holds the input
and output processors.

    add_request(prompt, params) ── InputProcessor.process ──► EngineCoreRequest
    add_processed_request(req)  ── backend.add_request (token ids + params); OutputProcessor.add_request
    step()                      ── backend.step() ──► OutputProcessor.process ──► [RequestOutput]
                                   (sequences a stop string ended ──► backend.abort_request)
"""

from __future__ import annotations

import itertools
import time
from typing import Any, Sequence

from armserve.config import ConfigError, EngineConfig
from armserve.engine.backend import EngineBackend
from armserve.engine.input_processor import EngineCoreRequest, InputProcessor, PromptType, RequestError
from armserve.engine.output_processor import OUTPUT_KINDS, OutputProcessor
from armserve.outputs import RequestOutput
from armserve.pooling_params import PoolingParams
from armserve.sampling_params import SamplingParams


def create_backend(config: EngineConfig) -> EngineBackend:
    """The backend `config.backend` names (the pooling backend for an embedding model,
    `config.runner`), with its model loaded; `config.runner` is resolved ("generate"/"pooling")."""
    from armserve.engine.pooling_backend import PoolingBackend, resolve_runner

    config.runner = resolve_runner(config)
    if config.runner == "pooling":
        if config.enable_lora:
            raise ConfigError("enable_lora applies to text generation, not to a pooling model")
        if config.speculative_config is not None:
            raise ConfigError("speculative_config applies to text generation, not to a pooling model")
        return PoolingBackend(config)
    if config.backend == "openvino":
        from armserve.engine.openvino_backend import OpenVINOBackend

        return OpenVINOBackend(config)
    from armserve.engine.torch_backend import TorchBackend

    return TorchBackend(config)


def input_processor_for(backend: EngineBackend) -> InputProcessor:
    """The input processor of `backend`'s model: its tokenizer and the limits of its model and KV cache."""
    tok = backend.tokenizer
    return InputProcessor(tok, backend.max_model_len, min(backend.vocab_size, len(tok)), backend.eos_token_ids,
                          backend.num_kv_blocks, backend.kv_block_size, backend.config.max_logprobs,
                          getattr(backend, "pooler", None))


def check_request(config: EngineConfig, request: EngineCoreRequest) -> None:
    """RequestError if the engine was not started for what `request` asks (a LoRA adapter)."""
    if request.lora_request is not None and not config.enable_lora:
        raise RequestError(f"the request asks for LoRA adapter {request.lora_request.lora_name!r}, but LoRA is "
                           "not enabled: start the engine with enable_lora=True (--enable-lora)")


def lora_manager(backend: EngineBackend) -> Any:
    """The backend's LoRA manager (RequestError when LoRA is not enabled)."""
    manager = getattr(backend, "lora", None)
    if manager is None:
        raise RequestError("LoRA is not enabled: start the engine with enable_lora=True (--enable-lora)")
    return manager


class LLMEngine:
    """One model's engine. Not thread-safe: one thread calls `add_request`, `abort_request` and `step`.

    The backend's `warm_up()` and `scheduler_stats()` (engine/backend.py) and its own parts (the
    torch backend's `kv`, `scheduler`, `runner`, `model`; OpenVINO's `ir_folder`) read through the
    engine.
    """

    def __init__(self, config: EngineConfig, log_stats: bool = False) -> None:
        self.config = config
        self.backend = backend = create_backend(config)
        self.tokenizer = backend.tokenizer
        self.max_model_len = backend.max_model_len
        self.structured = backend.structured
        self.input_processor = input_processor_for(backend)
        self.output_processor = OutputProcessor(self.tokenizer, log_stats)
        self._ids = itertools.count()

    def __getattr__(self, name: str) -> Any:
        if name == "backend":  # (not set yet: __init__ failed)
            raise AttributeError(name)
        return getattr(self.backend, name)

    def add_request(self, request_id: str | None, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None, output_kind: str = "final", lora_request: Any = None) -> str:
        """Process and queue a request; raises `RequestError`/`ValueError` naming the problem,
        leaving the engine untouched. `output_kind`: "final" (one output at the end),
        "cumulative" or "delta" (every step); `lora_request`: a lora.LoRARequest (None: the base
        model). Returns the request id (None: the next number)."""
        if output_kind not in OUTPUT_KINDS:
            raise RequestError(f"output_kind must be one of {OUTPUT_KINDS}, got {output_kind!r}")
        request_id = str(next(self._ids)) if request_id is None else request_id
        self.add_processed_request(self.input_processor.process(request_id, prompt, params, arrival_time,
                                                                lora_request), output_kind)
        return request_id

    def add_pooling_request(self, request_id: str | None, prompt: PromptType, params: PoolingParams | None = None,
                            arrival_time: float | None = None) -> str:
        """`add_request` of an input to pool (an embedding model's engine); its one output carries
        the vector in `pooled`."""
        request_id = str(next(self._ids)) if request_id is None else request_id
        self.add_processed_request(self.input_processor.process_pooling(request_id, prompt, params, arrival_time))
        return request_id

    def add_processed_request(self, request: EngineCoreRequest, output_kind: str = "final") -> None:
        """Queue a request the input processor made (the engine core's requests come so)."""
        if request.request_id in self.output_processor.requests:
            raise RequestError(f"request id {request.request_id!r} is already in use")
        check_request(self.config, request)
        self.backend.add_request(request)  # ValueError naming what the backend cannot carry
        self.output_processor.add_request(request, output_kind)

    def add_lora(self, lora_request: Any) -> None:
        """Read an adapter (lora.LoRARequest) into the LoRA cache now, checking it against the
        model; a LoRAError (ValueError) names what is wrong with its folder."""
        lora_manager(self.backend).add(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (cache and slot); False if it was not loaded."""
        return lora_manager(self.backend).remove(lora_int_id)

    def abort_request(self, request_ids: str | Sequence[str]) -> list[RequestOutput]:
        """Stop requests now and free their cache; returns each one's last output (its unfinished
        completions ended "abort"). Unknown ids are ignored."""
        outputs = []
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            out = self.output_processor.abort_request(rid)
            if out is not None:
                self.backend.abort_request(rid)
                outputs.append(out)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.requests)

    def step(self) -> list[RequestOutput]:
        """Run one engine iteration; outputs of the requests that progressed (per their output kind)."""
        scheduled = time.time()
        out = self.backend.step()
        outputs, stopped = self.output_processor.process(out, scheduled, time.time())
        for rid, index in stopped:
            self.backend.abort_request(rid, [index])
        return outputs
