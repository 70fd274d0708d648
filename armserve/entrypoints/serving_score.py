"""POST /score, /v1/score (vLLM's shape) and /rerank, /v1/rerank, /v2/rerank (Jina's and Cohere's):
a cross-encoder scores each (query, document) pair in one input `[CLS] query [SEP] document [SEP]`
(its sigmoid: what sentence-transformers' CrossEncoder returns), a decoder reranker the pair as one
text (or rendered by the score template: prompts.encode_pair); an embedding model scores the
cosine similarity of the two texts' vectors (the query embedded once).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import numpy as np
from fastapi import Request

from armserve.config import MAX_EMBEDDING_INPUTS
from armserve.engine.input_processor import EngineCoreRequest
from armserve.entrypoints.protocol import APIError, RerankRequest, ScoreRequest
from armserve.entrypoints.serving import OpenAIServing
from armserve.entrypoints.serving_embedding import pooling_request, run_pooling
from armserve.pooling_params import PoolingParams, PoolingParamsError
from armserve.prompts import PromptError, encode_pair, score_pairs


class OpenAIServingScore:
    """The score and rerank endpoints over the shared `OpenAIServing`."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def scores(self, raw: Request, pairs: list[tuple[str, str]], truncate: int | None,
                     param: str) -> tuple[list[float], int]:
        """(each pair's score, prompt tokens used); 400s name `param`."""
        serving = self.serving
        if len(pairs) > MAX_EMBEDDING_INPUTS:
            raise APIError(f"{len(pairs)} pairs to score; at most {MAX_EMBEDDING_INPUTS} per request", 400, param)
        try:
            params = PoolingParams(truncate_prompt_tokens=truncate)
        except PoolingParamsError as e:
            raise APIError(str(e), 400, "truncate_prompt_tokens") from None
        rid = f"score-{uuid.uuid4().hex}"
        classify = serving.task == "classify"
        k = params.max_tokens(serving.engine.max_model_len)
        pooler = serving.engine.input_processor.pooler
        # a cross-encoder's inputs are the pairs; an embedding model's each distinct text, once
        texts = [] if classify else list(dict.fromkeys(t for pair in pairs for t in pair))

        def process(tok: Any) -> list[EngineCoreRequest]:
            requests = []
            for i, item in enumerate(pairs if classify else texts):
                where = f"{param}[{i}]"
                if classify:
                    a, b = item
                    if not a or not b:
                        raise APIError(f"{where}: the query and the document must not be empty", 400, param)
                    try:
                        prompt: Any = {"prompt_token_ids": encode_pair(tok, a, b, k, pooler.use_sep_token,
                                                                          pooler.score_template)}
                    except PromptError as e:
                        raise APIError(f"{where}: {e}", 400, param) from None
                else:
                    if not item:
                        raise APIError(f"{where}: empty text", 400, param)
                    prompt = {"prompt": item}
                requests.append(pooling_request(serving, f"{rid}-{i}", prompt,
                                                params if not classify else PoolingParams(), tok, where))
            return requests

        requests = await serving.prepare(raw, process)
        outs = await run_pooling(serving, requests)
        tokens = sum(len(r.prompt_token_ids) for r in requests)
        if classify:
            if outs and outs[0].shape[-1] != 1:
                raise APIError(f"scoring needs a cross-encoder with one label; this model has {outs[0].shape[-1]}",
                               400, "model")
            return [float(o[0]) for o in outs], tokens
        index = {t: i for i, t in enumerate(texts)}
        vecs = np.stack(outs).astype(np.float64)
        vecs /= np.maximum(np.linalg.norm(vecs, axis=-1, keepdims=True), 1e-12)  # (torch's normalize)
        return [float(vecs[index[a]] @ vecs[index[b]]) for a, b in pairs], tokens

    async def create_score(self, body: ScoreRequest, raw: Request) -> dict[str, Any]:
        body.warn_ignored_fields()
        model = self.serving.model_name(body.model)
        try:
            pairs = score_pairs(body.text_1, body.text_2)  # type: ignore[arg-type]
        except PromptError as e:
            raise APIError(str(e), 400, "text_2") from None
        scores, tokens = await self.scores(raw, pairs, body.truncate_prompt_tokens, "text_2")
        return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
                "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}}

    async def create_rerank(self, body: RerankRequest, raw: Request) -> dict[str, Any]:
        body.warn_ignored_fields()
        model = self.serving.model_name(body.model)
        docs = body.texts()
        if not docs:
            raise APIError("documents must not be empty", 400, "documents")
        scores, tokens = await self.scores(raw, [(body.query, d) for d in docs], body.truncate_prompt_tokens,
                                           "documents")
        order = sorted(range(len(docs)), key=lambda i: -scores[i])
        if body.top_n:
            order = order[:body.top_n]
        results = [{"index": i, "relevance_score": scores[i],
                    **({"document": {"text": docs[i]}} if body.return_documents else {})} for i in order]
        return {"id": f"rerank-{uuid.uuid4().hex}", "model": model, "usage": {"total_tokens": tokens},
                "results": results}
