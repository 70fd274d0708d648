"""The offline Python API: `LLM(model).generate(prompts, params)` and `LLM.chat(messages)`."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Sequence

from armserve import model_loader
from armserve.prompts import encode_pair, render_chat, score_pairs
from armserve.config import TASK_RUNNERS, EngineConfig, check_engine_args
from armserve.engine.input_processor import PromptType
from armserve.engine.llm_engine import LLMEngine
from armserve.lora.request import LoRARequest
from armserve.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from armserve.pooling_params import PoolingParams
from armserve.sampling_params import SamplingParams

ChatMessages = list[dict[str, Any]]


class LLM:
    """An offline engine over one model.

    `model` is a Hugging Face folder or a GGUF file. Engine arguments use vLLM's names
    (`dtype`, `max_model_len`, `max_num_batched_tokens`, `max_num_seqs`, `block_size`,
    `enable_prefix_caching`, `seed`) plus `kv_cache_space` in GiB. `backend="openvino"` serves
    it through OpenVINO GenAI instead of armserve's own engine (engine/openvino_backend.py).
    `enable_lora=True` (with `max_loras`, `max_lora_rank`, `max_cpu_loras`) serves PEFT LoRA
    adapters: `generate(..., lora_request=LoRARequest(name, id, path))` (docs/lora.md).
    `runner` ("auto", "generate", "pooling"; vLLM's older `task="embed"` too) says what the model
    is for: "auto" pools with an embedding model (BertModel, ...; then use `embed`).
    """

    def __init__(self, model: str, **engine_args: Any) -> None:
        if "task" in engine_args:  # vLLM's older name for runner
            task = engine_args.pop("task")
            if task not in TASK_RUNNERS:
                raise ValueError(f"unknown task {task!r}; expected one of {', '.join(TASK_RUNNERS)}")
            engine_args.setdefault("runner", TASK_RUNNERS[task])
        check_engine_args(engine_args)
        self.llm_engine = LLMEngine(EngineConfig(model=model, **engine_args))

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The sampling parameters `generate` and `chat` use when given none: the model's
        generation_config.json values (temperature, top_p, top_k, min_p, repetition_penalty,
        max_tokens) over SamplingParams' own, unless `generation_config="vllm"`."""
        cfg = self.llm_engine.config
        return SamplingParams(**model_loader.generation_defaults(cfg.model, cfg.generation_config))

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate completions for one or many prompts; outputs come back in prompt order.

        A prompt is a string, a list of token ids, or `{"prompt_token_ids": [...]}`.
        `sampling_params` is one `SamplingParams` for all prompts or one per prompt;
        `lora_request` (with `enable_lora=True`) one adapter for all or one per prompt (None: the base).
        """
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"got {len(params_list)} sampling params for {len(prompts)} prompts; pass one or one per prompt"
                )
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"got {len(loras)} lora requests for {len(prompts)} prompts; pass one or one per prompt")
        engine = self.llm_engine
        ids: list[str] = []
        try:
            for prompt, params, lora in zip(prompts, params_list, loras):
                ids.append(engine.add_request(None, prompt, params, lora_request=lora))
        except Exception:
            engine.abort_request(ids)  # leave the engine as it was
            raise
        return self._run(ids, use_tqdm)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """Embed one or many inputs with an embedding model (runner pooling); outputs in input
        order, each `out.outputs.embedding` a list of floats (vLLM's shape)."""
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        params = pooling_params or PoolingParams()
        if truncate_prompt_tokens is not None:
            params = replace(params, truncate_prompt_tokens=truncate_prompt_tokens)
        self._require_pooling("embed", "embed")
        return [EmbeddingRequestOutput.from_output(o) for o in self._pool(list(prompts), params, use_tqdm)]

    def classify(self, prompts: PromptType | Sequence[PromptType], use_tqdm: bool = True,
                 truncate_prompt_tokens: int | None = None) -> list[ClassificationRequestOutput]:
        """Class probabilities of each input with a sequence-classification model (a
        cross-encoder): `out.outputs.probs` (sigmoid of a single logit, else softmax)."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        self._require_pooling("classify", "classify")
        outs = self._pool(list(prompts), PoolingParams(truncate_prompt_tokens=truncate_prompt_tokens), use_tqdm)
        return [ClassificationRequestOutput(o.request_id, ClassificationOutput(o.pooled.tolist()), o.prompt_token_ids)
                for o in outs]

    def score(self, data_1: str | Sequence[str], data_2: str | Sequence[str], use_tqdm: bool = True,
              truncate_prompt_tokens: int | None = None) -> list[ScoringRequestOutput]:
        """Scores of (data_1, data_2) pairs (one text against many, or side by side), as vLLM's:
        a cross-encoder's relevance probability of each pair, or with an embedding model the cosine
        similarity of the two texts' vectors. `out.outputs.score`."""
        pairs = score_pairs(data_1, data_2)  # type: ignore[arg-type]
        task = self._require_pooling(None, "score")
        params = PoolingParams(truncate_prompt_tokens=truncate_prompt_tokens)
        if task == "classify":
            tok, pooler = self.llm_engine.tokenizer, self.llm_engine.input_processor.pooler
            k = params.max_tokens(self.llm_engine.max_model_len)
            outs = self._pool([{"prompt_token_ids": encode_pair(tok, a, b, k, pooler.use_sep_token,
                                                                pooler.score_template)} for a, b in pairs],
                              PoolingParams(), use_tqdm)
            if outs and outs[0].pooled.shape[-1] != 1:
                raise ValueError("score needs a cross-encoder with one label; this model has "
                                 f"{outs[0].pooled.shape[-1]}: use classify")
            return [ScoringRequestOutput(o.request_id, ScoringOutput(float(o.pooled[0])), o.prompt_token_ids)
                    for o in outs]
        texts = [a for a, _ in pairs] + [b for _, b in pairs]
        outs = self._pool(texts, replace(params, normalize=True), use_tqdm)
        n = len(pairs)
        return [ScoringRequestOutput(f"{outs[i].request_id}-{outs[n + i].request_id}",
                                     ScoringOutput(float(outs[i].pooled @ outs[n + i].pooled)),
                                     outs[i].prompt_token_ids + outs[n + i].prompt_token_ids)
                for i in range(n)]

    def _require_pooling(self, task: str | None, what: str) -> str:
        """The engine's pooling task ("embed"/"classify"); a ValueError naming `what` when the
        model cannot do it (`task` None: either)."""
        pooler = self.llm_engine.input_processor.pooler
        if pooler is None:
            raise ValueError(f"{what} needs a pooling model (runner pooling); this one generates text")
        if task is not None and pooler.task != task:
            raise ValueError(f"{what} needs a model that can {task}; this one is a{'n embedding' if pooler.task == 'embed' else ' classification'} model")
        return pooler.task

    def _pool(self, prompts: list[PromptType], params: PoolingParams, use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        ids: list[str] = []
        try:
            for prompt in prompts:
                ids.append(engine.add_pooling_request(None, prompt, params))
        except Exception:
            engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: ChatMessages | Sequence[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them) and generate.

        `tools` (OpenAI function tools) reach the template; to force a call, constrain the output
        with `SamplingParams(structured_outputs=StructuredOutputsParams(json=...))`.
        """
        one = bool(messages) and isinstance(messages[0], dict)
        convs: list[ChatMessages] = [messages] if one else list(messages)  # type: ignore[list-item, arg-type]
        prompts = [
            {"prompt_token_ids": self.encode_chat(c, add_generation_prompt, chat_template, tools)} for c in convs
        ]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def encode_chat(
        self, messages: ChatMessages, add_generation_prompt: bool = True, chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of a conversation rendered with the chat template (armserve/prompts.py)."""
        return render_chat(self.llm_engine.tokenizer, messages, tools=tools,
                           add_generation_prompt=add_generation_prompt, chat_template=chat_template)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        pending = set(ids)
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        start = time.perf_counter()
        in_tokens = out_tokens = 0
        try:
            while pending:
                for out in engine.step():
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        results[out.request_id] = out
                        if bar is not None:
                            in_tokens += len(out.prompt_token_ids)
                            out_tokens += sum(len(o.token_ids) for o in out.outputs)
                            dt = time.perf_counter() - start
                            bar.set_postfix_str(
                                f"est. speed input: {in_tokens / dt:.2f} toks/s, output: {out_tokens / dt:.2f} toks/s"
                            )
                            bar.update(1)
        except BaseException:
            engine.abort_request(list(pending))
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[i] for i in ids]
