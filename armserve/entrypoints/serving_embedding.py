"""POST /v1/embeddings (OpenAI's shape) and /pooling (vLLM's): inputs (a text, texts, token ids or
lists of them) -> pooling requests to the engine (engine/pooling_backend.py) -> one vector each,
as float lists or base64 of little-endian float32 (what the `openai` client decodes).
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from typing import Any

import numpy as np
from fastapi import Request

from armserve.config import MAX_EMBEDDING_INPUTS
from armserve.engine.input_processor import ContextLengthError, EngineCoreRequest, PromptTokensError, RequestError
from armserve.entrypoints.protocol import APIError, EmbeddingRequest
from armserve.entrypoints.serving import OpenAIServing, collect
from armserve.pooling_params import PoolingParams, PoolingParamsError
from armserve.prompts import PromptError, check_text


def encode_vector(vector: Any, encoding_format: str) -> list[float] | str:
    """A float32 vector as JSON floats, or as base64 of its little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return vector.tolist()


def pooling_request(serving: OpenAIServing, request_id: str, prompt: Any, params: PoolingParams, tok: Any,
                    param: str) -> EngineCoreRequest:
    """`process_pooling` with its refusals as 400s naming `param` (the input's place in the body)."""
    try:
        return serving.engine.input_processor.process_pooling(request_id, prompt, params, tokenizer=tok)
    except ContextLengthError as e:
        raise serving.context_error(f"{param} has {e.num_prompt_tokens} tokens. Shorten it or set "
                                    "truncate_prompt_tokens.", param.split("[")[0]) from None
    except (PromptTokensError, PromptError) as e:
        raise APIError(f"{param}: {e}", 400, param.split("[")[0]) from None
    except RequestError as e:  # dimensions the model cannot give
        raise APIError(str(e), 400, "dimensions" if "dimensions" in str(e) else param.split("[")[0]) from None


async def run_pooling(serving: OpenAIServing, requests: list[EngineCoreRequest]) -> list[Any]:
    """Each request's pooled output, in order; at most max_num_seqs of them in the engine at once,
    so that a large batch never trips the server's own admission limit."""
    window = serving.engine.config.max_num_seqs
    vectors: list[Any] = []
    for start in range(0, len(requests), window):
        streams = []
        try:
            for r in requests[start:start + window]:
                streams.append(await serving.submit(r))
            outs = await asyncio.gather(*(collect(s, 1) for s in streams))
        finally:
            for s in streams:  # one failure: leave nothing of the batch running
                s.close()
        vectors.extend(out.pooled for _, out in outs)
    return vectors


class OpenAIServingEmbedding:
    """The embeddings and pooling endpoints over the shared `OpenAIServing`."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create_embedding(self, body: EmbeddingRequest, raw: Request, pooling: bool = False) -> dict[str, Any]:
        """POST /v1/embeddings (`pooling`: /pooling, vLLM's response shape)."""
        body.warn_ignored_fields()
        serving = self.serving
        model = serving.model_name(body.model)
        inputs = body.inputs()
        if not inputs:
            raise APIError("input must not be an empty list", 400, "input")
        if len(inputs) > MAX_EMBEDDING_INPUTS:
            raise APIError(f"input has {len(inputs)} items; at most {MAX_EMBEDDING_INPUTS} per request",
                           400, "input")
        try:
            params = PoolingParams(body.dimensions, body.normalize, body.truncate_prompt_tokens)
        except PoolingParamsError as e:
            raise APIError(str(e), 400, str(e).split()[0]) from None
        rid = f"embd-{uuid.uuid4().hex}"

        def process(tok: Any) -> list[EngineCoreRequest]:
            requests = []
            for i, p in enumerate(inputs):
                param = "input" if len(inputs) == 1 else f"input[{i}]"
                prompt: Any = p
                if isinstance(p, str):
                    try:
                        if not check_text(p, param):
                            raise APIError(f"{param} is an empty string", 400, "input")
                    except PromptError as e:
                        raise APIError(str(e), 400, "input") from None
                    prompt = {"prompt": p}
                    if not body.add_special_tokens:
                        prompt["prompt_token_ids"] = tok.encode(p, add_special_tokens=False)
                requests.append(pooling_request(serving, f"{rid}-{i}", prompt, params, tok, param))
            return requests

        requests = await serving.prepare(raw, process)
        vectors = await run_pooling(serving, requests)
        num_tokens = sum(len(r.prompt_token_ids) for r in requests)
        kind = "pooling" if pooling else "embedding"
        data = [{"index": i, "object": kind, ("data" if pooling else "embedding"): encode_vector(v, body.encoding_format)}
                for i, v in enumerate(vectors)]
        return {"id": rid, "object": "list", "created": int(time.time()), "model": model, "data": data,
                "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens, "completion_tokens": 0,
                          "prompt_tokens_details": None}}
