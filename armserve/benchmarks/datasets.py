"""Benchmark prompts: random text of an exact token length, or prompts read from a file.

Lengths are counted with the target model's tokenizer: a local one (HF folder or GGUF file) or,
when none is given, the server's own through its `/tokenize` and `/detokenize` endpoints.
Prompts are built once, from a seed, so every system in a comparison gets the same text.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

# Plain words, so random prompts look like text to every tokenizer (random token ids can decode
# to byte fragments that re-tokenize to a different length on each server).
_WORDS = (
    "time person year way day thing man world life hand part child eye woman place work week case "
    "point government company number group problem fact water river stone light music garden window "
    "paper market engine signal memory story morning winter summer forest mountain ocean island bridge "
    "street village kitchen table letter animal color answer question reason moment heart voice "
    "history science nature energy power field system model matter circle corner doctor teacher farmer "
    "good new first last long great little own other old right big high different small large next "
    "early young important few public bad same able quick quiet bright dark warm cold simple careful "
    "make know take see come think look want give use find tell ask seem feel try leave call keep "
    "begin show hear play run move live believe hold bring happen write provide sit stand lose pay meet "
    "include continue learn change lead understand watch follow stop create speak read spend grow open "
    "walk win offer remember love consider appear buy wait serve die send expect build stay fall cut "
    "reach kill remain suggest raise pass sell require report decide pull return explain hope develop"
).split()


class Tokenizer(Protocol):
    """The two calls prompt building needs (a Hugging Face tokenizer has them)."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass(slots=True)
class SampleRequest:
    """One benchmark request: its prompt text, the prompt's token count and the output length asked."""

    prompt: str
    prompt_len: int
    expected_output_len: int


def load_local_tokenizer(path: str):
    """A Hugging Face tokenizer from a model folder, a tokenizer folder or a GGUF file."""
    from armserve.model_loader import load_tokenizer, resolve_model_path

    path = os.path.expanduser(path)
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "tokenizer.json")) \
            and not os.path.isfile(os.path.join(path, "config.json")):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    return load_tokenizer(resolve_model_path(path))


class ServerTokenizer:
    """Tokenize through a running server: vLLM/armserve (`/tokenize` with `prompt`) or llama-server
    (`/tokenize` with `content`). Without special tokens, so lengths match what we send as text."""

    def __init__(self, server_url: str, model: str | None = None, timeout: float = 60.0) -> None:
        import httpx

        self._client = httpx.Client(base_url=server_url.rstrip("/"), timeout=timeout)
        self._model = model
        self._style: str | None = None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        body_vllm: dict[str, Any] = {"prompt": text, "add_special_tokens": add_special_tokens}
        if self._model:
            body_vllm["model"] = self._model
        body_llama = {"content": text, "add_special": add_special_tokens}
        for style, body in (("vllm", body_vllm), ("llama", body_llama)):
            if self._style not in (None, style):
                continue
            r = self._client.post("/tokenize", json=body)
            if r.status_code == 200 and isinstance(r.json().get("tokens"), list):
                self._style = style
                return [int(t) for t in r.json()["tokens"]]
        raise RuntimeError(f"the server at {self._client.base_url} has no usable /tokenize endpoint; "
                           "pass --tokenizer PATH (a local tokenizer of the served model)")

    def decode(self, ids: list[int]) -> str:
        r = self._client.post("/detokenize", json={"tokens": ids, **({"model": self._model} if self._model
                                                                       and self._style == "vllm" else {})})
        r.raise_for_status()
        data = r.json()
        return data["prompt"] if "prompt" in data else data["content"]


def _encode(tok: Tokenizer, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def fit_to_length(tok: Tokenizer, ids: list[int], target: int, filler: list[int]) -> tuple[str, int]:
    """Text whose tokenization has exactly `target` tokens, starting from token ids `ids`.

    Decoding and re-encoding can merge or split tokens at the cut, so trim or extend and repeat
    until the length is stable; returns the text and its token count (target, unless it never
    settles, which has not been seen with BPE or SentencePiece tokenizers).
    """
    if target <= 0:
        return "", 0
    filler = filler or ids or [0]
    i = 0
    ids = list(ids)
    text, n = "", -1
    for _ in range(16):
        while len(ids) < target:
            ids.append(filler[i % len(filler)])
            i += 1
        text = tok.decode(ids[:target])
        ids = _encode(tok, text)
        n = len(ids)
        if n == target:
            return text, n
    return text, n


def _sample_lens(rng: np.random.Generator, mean: int, ratio: float, num: int, name: str) -> np.ndarray:
    if mean < 1:
        raise ValueError(f"{name} must be >= 1, got {mean}")
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {ratio}")
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return rng.integers(lo, hi + 1, size=num)


def random_requests(tok: Tokenizer, num: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                    prefix_len: int = 0, seed: int = 0) -> list[SampleRequest]:
    """`num` prompts of random words with `prefix_len` shared tokens, then input lengths drawn uniformly
    from input_len * [1 - ratio, 1 + ratio] (the same for output lengths), as vLLM's random dataset."""
    if num < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num}")
    rng = np.random.default_rng(seed)
    in_lens = _sample_lens(rng, input_len, range_ratio, num, "--input-len")
    out_lens = _sample_lens(rng, output_len, range_ratio, num, "--output-len")

    def words(n_tokens: int) -> list[int]:
        # About one token per word for common English words; ask for more than needed.
        text = " ".join(rng.choice(_WORDS, size=max(8, n_tokens + 8)))
        return _encode(tok, " " + text)

    prefix_ids = words(prefix_len)[:prefix_len] if prefix_len > 0 else []
    out: list[SampleRequest] = []
    for n_in, n_out in zip(in_lens, out_lens):
        body = words(int(n_in))
        text, n = fit_to_length(tok, prefix_ids + body, prefix_len + int(n_in), body)
        out.append(SampleRequest(text, n, int(n_out)))
    return out


def _read_prompt_file(path: str) -> list[tuple[str, int | None]]:
    """Prompts from `.jsonl` (objects with "prompt", optional "output_len"), `.json` (a list of
    strings or such objects) or any other text file (one prompt per non-empty line)."""
    if not os.path.isfile(path):
        raise ValueError(f"--dataset-path {path!r} is not a file")
    items: list[Any]
    with open(path, encoding="utf-8") as f:
        if path.endswith(".jsonl"):
            items = [json.loads(line) for line in f if line.strip()]
        elif path.endswith(".json"):
            items = json.load(f)
            if not isinstance(items, list):
                raise ValueError(f"{path}: a .json prompt file must hold a list")
        else:
            items = [line.rstrip("\n") for line in f if line.strip()]
    out: list[tuple[str, int | None]] = []
    for k, item in enumerate(items):
        if isinstance(item, str):
            out.append((item, None))
        elif isinstance(item, dict) and isinstance(item.get("prompt"), str):
            n = item.get("output_len", item.get("output_tokens"))
            out.append((item["prompt"], int(n) if n is not None else None))
        else:
            raise ValueError(f"{path}: entry {k} is neither a string nor an object with a 'prompt' string")
    if not out:
        raise ValueError(f"{path} holds no prompts")
    return out


def file_requests(tok: Tokenizer, path: str, num: int, output_len: int,
                  input_len: int | None = None) -> list[SampleRequest]:
    """`num` prompts from a file, in order (cycled if the file is shorter). With `input_len`, each is
    cut or extended (with the file's following text) to exactly that many tokens."""
    if num < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num}")
    entries = _read_prompt_file(path)
    out: list[SampleRequest] = []
    for k in range(num):
        text, n_out = entries[k % len(entries)]
        n_out = n_out or output_len
        if input_len:
            ids = _encode(tok, text)
            follow: list[int] = []
            j = 1
            while len(ids) + len(follow) < input_len and j <= len(entries):  # borrow the next prompts' text
                follow += _encode(tok, " " + entries[(k + j) % len(entries)][0])
                j += 1
            text, n = fit_to_length(tok, ids, input_len, follow)
        else:
            n = len(_encode(tok, text))
        out.append(SampleRequest(text, n, int(n_out)))
    return out
