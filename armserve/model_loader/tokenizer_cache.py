"""GGUF tokenizers kept on disk once converted.

transformers builds a GGUF file's tokenizer from its header on every load, each vocabulary entry
and merge as a Python value: about 2 s of CPU for SmolLM2, 3 s for Qwen2.5, 8 s for Gemma 3's
262k entries, paid by every engine start. The converted tokenizer is saved once under
`cache_dir("tokenizers")`, keyed by the file and the transformers / tokenizers versions, and later
loads read it back as the same class around the same `tokenizers` backend (its JSON, not rebuilt:
from a saved folder, model-specific classes such as Qwen2Tokenizer rebuild their backend from the
vocabulary with their own normalizer, which the GGUF conversion does not have).

A conversion is kept only when its reload is verified identical (backend, special tokens, chat
template, BOS/EOS flags); one that is not is marked, and converted on every load as before.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from typing import Any, Callable

from armserve.config import cache_dir
from armserve.model_loader.gguf import _file_key

log = logging.getLogger(__name__)

# Bumped when what is saved changes, so older entries are not read.
FORMAT = 1
BACKEND_FILE = "backend.json"  # (not tokenizer.json: from_pretrained would rebuild the backend from it)
META_FILE = "armserve.json"
# Attributes a reload must reproduce (with the backend's JSON, the added tokens and the class).
_COMPARED = ("add_bos_token", "add_eos_token", "bos_token", "eos_token", "pad_token", "unk_token", "bos_token_id",
             "eos_token_id", "pad_token_id", "all_special_ids", "all_special_tokens", "model_max_length",
             "padding_side", "truncation_side", "clean_up_tokenization_spaces", "split_special_tokens",
             "chat_template")


def cached_gguf_tokenizer(path: str, convert: Callable[[], Any]) -> Any:
    """The tokenizer of the GGUF file `path`: read from the cache, else `convert()`ed and cached."""
    folder = os.path.join(cache_dir("tokenizers"), _key(path))
    meta = _meta(folder)
    if meta is not None and meta.get("usable"):
        try:
            return _read(folder, meta, os.path.dirname(os.path.abspath(path)))
        except Exception as e:  # a damaged entry or a transformers that reads it otherwise: convert again
            log.warning("the cached tokenizer %s did not load (%s); converting %s again", folder, e, path)
            shutil.rmtree(folder, ignore_errors=True)
            meta = None
    tok = convert()
    if meta is None:
        try:
            _save(tok, folder)
        except OSError as e:  # a read-only or full cache only costs the conversion next time
            log.info("cannot cache the tokenizer of %s in %s: %s", path, folder, e)
    return tok


def is_cached(path: str) -> bool:
    """Whether the tokenizer of the GGUF file `path` will be read from the cache, not converted."""
    meta = _meta(os.path.join(cache_dir("tokenizers"), _key(path)))
    return bool(meta and meta.get("usable"))


def _key(path: str) -> str:
    import tokenizers
    import transformers

    what = (*_file_key(path), transformers.__version__, tokenizers.__version__, FORMAT)
    return hashlib.sha1(repr(what).encode()).hexdigest()[:20]


def _meta(folder: str) -> dict | None:
    try:
        with open(os.path.join(folder, META_FILE)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _read(folder: str, meta: dict, name_or_path: str) -> Any:
    import transformers
    from tokenizers import Tokenizer

    cls = getattr(transformers, meta["class"])
    backend = Tokenizer.from_file(os.path.join(folder, BACKEND_FILE))
    # (add_bos_token / add_eos_token: save_pretrained leaves them out, and the GGUF conversion sets them)
    tok = cls.from_pretrained(folder, tokenizer_object=backend, add_bos_token=meta["add_bos_token"],
                              add_eos_token=meta["add_eos_token"])
    tok.name_or_path = name_or_path  # (as the conversion names it: the GGUF file's folder)
    return tok


def _fingerprint(tok: Any) -> dict:
    out = {k: getattr(tok, k, None) for k in _COMPARED}
    out["class"] = type(tok).__name__
    out["backend"] = tok.backend_tokenizer.to_str()
    out["added"] = {i: repr(t) for i, t in tok.added_tokens_decoder.items()}
    out["len"] = len(tok)
    return out


def _save(tok: Any, folder: str) -> None:
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(folder) + ".", dir=os.path.dirname(folder))
    try:
        meta = {"class": type(tok).__name__, "add_bos_token": bool(getattr(tok, "add_bos_token", False)),
                "add_eos_token": bool(getattr(tok, "add_eos_token", False)), "usable": False}
        tok.save_pretrained(tmp)
        os.replace(os.path.join(tmp, "tokenizer.json"), os.path.join(tmp, BACKEND_FILE))
        try:
            meta["usable"] = _fingerprint(_read(tmp, meta, tok.name_or_path)) == _fingerprint(tok)
        except Exception as e:  # a class this transformers cannot build so: not cached, converted each load
            log.info("the tokenizer of class %s does not reload from %s: %s", meta["class"], tmp, e)
        if not meta["usable"]:
            for name in os.listdir(tmp):  # keep only the mark, not megabytes of vocabulary
                os.remove(os.path.join(tmp, name))
        with open(os.path.join(tmp, META_FILE), "w") as f:
            json.dump(meta, f)
        try:
            os.rename(tmp, folder)
        except OSError:  # another process cached it first
            if _meta(folder) is None:
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
