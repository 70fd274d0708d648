"""Structured outputs on xgrammar: compile a request's constraint once, then each step mask the
logits of its rows to the tokens the grammar allows.

    add_request   StructuredOutputsParams -> CompiledGrammar (LRU cache) -> a GrammarMatcher per child
    each step     fill_bitmask(matchers of the sampling rows) [while the model runs, on a worker thread]
                  sampler: apply_grammar_bitmask(logits, bitmask, rows) before penalties and sampling
    update        matcher.accept_token(sampled); a terminated grammar finishes the request ("stop")

A preempted request keeps its output tokens and recomputes their KV, so its matcher (which has
accepted exactly those tokens) stays valid: nothing to roll back.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from armserve.sampling_params import StructuredOutputsParams

# Compiled grammars kept per (kind, spec); a JSON schema compiles in ~0.1 s, a hit is free.
GRAMMAR_CACHE_SIZE = 256

_XGR_LOG_PREFIX = re.compile(r"^\s*(\[[\d:]+\]\s*)?\S+\.(cc|h):\d+:\s*")


def _clean(e: Exception) -> str:
    """xgrammar's message without its C++ log prefix (timestamp, source file and line)."""
    return _XGR_LOG_PREFIX.sub("", str(e)).strip()


def choice_grammar(choices: list[str]) -> str:
    """EBNF accepting exactly one of `choices` (JSON string escapes are EBNF string escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class StructuredOutputManager:
    """One engine's xgrammar state: tokenizer info (built on first use), compiler, grammar cache.

    `vocab_size` is the width of the model's logits, which may exceed the tokenizer's (padded
    embeddings): the ids past the tokenizer are never allowed.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: set[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self._compiler = None
        self._cache: OrderedDict[tuple[str, str, bool], Any] = OrderedDict()
        # The server compiles on worker threads (AsyncLLM.add_request) while the engine thread looks
        # grammars up: the lock guards the cache and the compiler's creation, not the compiles.
        self._lock = threading.Lock()
        self._worker: ThreadPoolExecutor | None = None

    def _get_compiler(self):
        with self._lock:
            return self._make_compiler()

    def _make_compiler(self):
        if self._compiler is None:
            try:
                import xgrammar as xgr
            except ImportError:
                raise ValueError("structured outputs need xgrammar: pip install 'armserve[structured]'") from None
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids or None)
            # NOTE: one compile thread: compiles run on the engine thread between steps.
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def compile(self, so: StructuredOutputsParams):
        """The compiled grammar of `so`, from the LRU cache when seen before. Raises ValueError
        naming the field and the problem for an invalid schema, regex or grammar."""
        key = so.cache_key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        compiler = self._get_compiler()
        kind = key[0]
        try:
            if kind == "json":
                any_ws = not so.disable_any_whitespace
                compiled = compiler.compile_json_schema(
                    key[1], any_whitespace=any_ws, separators=None if any_ws else (", ", ": "))
            elif kind == "json_object":
                compiled = compiler.compile_builtin_json_grammar()
            elif kind == "regex":
                compiled = compiler.compile_regex(so.regex)
            elif kind == "choice":
                compiled = compiler.compile_grammar(choice_grammar(so.choice))  # type: ignore[arg-type]
            else:
                compiled = compiler.compile_grammar(so.grammar)
        except (RuntimeError, ValueError, TypeError) as e:
            what = {"json": "JSON schema", "regex": "regex", "grammar": "grammar (EBNF)", "choice": "choice",
                    "json_object": "JSON grammar"}[kind]
            raise ValueError(f"structured_outputs.{kind}: invalid {what}: {_clean(e)}") from None
        with self._lock:
            self._cache[key] = compiled
            if len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def new_matcher(self, compiled):
        import xgrammar as xgr

        return xgr.GrammarMatcher(compiled)

    # ---- per step ----------------------------------------------------------------------------

    def fill_bitmask(self, matchers: list) -> torch.Tensor:
        """The allowed-token bitmask [len(matchers), ceil(vocab / 32)] int32 of each matcher's
        next token (bit t of the row: token t allowed)."""
        words = -(-self.vocab_size // 32)
        bitmask = torch.empty(len(matchers), words, dtype=torch.int32)
        arr = bitmask.numpy()
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(arr, i)
        return bitmask

    def fill_bitmask_async(self, matchers: list) -> Future:
        """`fill_bitmask` on a worker thread, so it overlaps the model's forward pass."""
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="armserve-grammar")
        return self._worker.submit(self.fill_bitmask, matchers)


# Byte value -> its 8 bits as additive logit masks (0 allowed, -inf not): one embedding lookup per
# bitmask byte unpacks a row (~30 us for a 50k vocabulary, 4x xgrammar's own CPU kernel here).
_BYTE_TO_MASK = torch.where(((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool(), 0.0, float("-inf"))


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Set, in place, the logits of tokens the grammar forbids to -inf in rows `rows` of `logits`
    [B, V] float32; row r of `bitmask` belongs to logits row rows[r]. Other rows are untouched."""
    # NOTE: the int32 words are little-endian on every platform we build for, so byte k of the
    # row covers tokens 8k..8k+7, bit b token 8k+b (xgrammar's layout).
    masks = torch.nn.functional.embedding(bitmask.view(torch.uint8).long(), _BYTE_TO_MASK)
    masks = masks.view(bitmask.shape[0], -1)[:, : logits.shape[1]]
    logits.index_add_(0, rows, masks)
