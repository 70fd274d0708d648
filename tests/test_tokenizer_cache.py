"""The on-disk cache of GGUF tokenizers (model_loader/tokenizer_cache.py), checked against
transformers' own conversion of the same file."""

from __future__ import annotations

import json
import logging
import os
import pickle

import pytest
from transformers import AutoTokenizer

from armserve.model_loader import load_tokenizer, resolve_model_path, tokenizer_cache

TEXTS = ["Hello world", "  def f(x):\n\treturn x ** 2  # ü 日本語 🙂", "e\u0301 caf\u00e9 \ufb01n\u2028x",
         "<|im_start|>user\nhi<|im_end|><|endoftext|>", ""]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}]


def assert_same_tokenizer(tok, ref) -> None:
    assert type(tok) is type(ref)
    # the backend whole: model, normalizer (the NFC a reloaded Qwen2Tokenizer would add), pre-tokenizer,
    # post-processor (BOS), decoder, added tokens
    assert tok.backend_tokenizer.to_str() == ref.backend_tokenizer.to_str()
    assert len(tok) == len(ref) and tok.get_vocab() == ref.get_vocab()
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id) == \
        (ref.bos_token_id, ref.eos_token_id, ref.pad_token_id, ref.unk_token_id)
    assert tok.all_special_ids == ref.all_special_ids
    assert (tok.add_bos_token, tok.add_eos_token) == (ref.add_bos_token, ref.add_eos_token)
    for text in TEXTS:
        for special in (True, False):
            assert tok(text, add_special_tokens=special).input_ids == ref(text, add_special_tokens=special).input_ids
    ids = ref(TEXTS[1] + TEXTS[3]).input_ids
    for skip in (True, False):
        assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    assert tok.chat_template == ref.chat_template
    if ref.chat_template:
        assert tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == \
            ref.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)


@pytest.fixture
def conversions(monkeypatch, tmp_path) -> list[str]:
    """transformers' GGUF tokenizer conversions from now on, with the cache in an empty folder."""
    from transformers.integrations import gguf as hf_gguf

    monkeypatch.setenv("ARMSERVE_CACHE_ROOT", str(tmp_path / "cache"))
    seen: list[str] = []
    original = hf_gguf.convert_gguf_tokenizer

    def counting(architecture, *args, **kwargs):
        seen.append(architecture)
        return original(architecture, *args, **kwargs)

    monkeypatch.setattr(hf_gguf, "convert_gguf_tokenizer", counting)
    return seen


def reference(path: str):
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def entries(root: str) -> list[str]:
    folder = os.path.join(root, "tokenizers")
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


@pytest.mark.parametrize("model", ["smollm2", "qwen"])
def test_second_load_reads_the_cache_and_is_the_same_tokenizer(model, request, conversions, tmp_path):
    path = request.getfixturevalue("smollm2_gguf" if model == "smollm2" else "qwen_coder_gguf")
    src = resolve_model_path(path)
    first = load_tokenizer(src)  # transformers' conversion (with the loader's lazy header reader)
    assert len(conversions) == 1
    # transformers on its own (its GGUFReader takes ~15 s over Qwen's header: SmolLM2 only; Qwen's is
    # the first load's, which test_gguf_reader ties to that reader)
    ref = reference(path) if model == "smollm2" else first
    (entry,) = entries(str(tmp_path / "cache"))
    with open(os.path.join(tmp_path / "cache" / "tokenizers" / entry, tokenizer_cache.META_FILE)) as f:
        assert json.load(f)["usable"] is True
    second = load_tokenizer(src)
    assert len(conversions) == 1 + (model == "smollm2"), "the second load converted the GGUF header again"
    assert_same_tokenizer(second, ref)
    assert second.name_or_path == ref.name_or_path
    if model == "smollm2":  # (what follows is the same code for both)
        assert_same_tokenizer(first, ref)
        assert_same_tokenizer(pickle.loads(pickle.dumps(second)), ref)  # (the front end gets it pickled)
        # a tokenizer= GGUF file takes the same entry
        assert_same_tokenizer(load_tokenizer(src, tokenizer=path), ref)
        assert len(conversions) == 2


def test_a_damaged_entry_is_converted_again_and_replaced(smollm2_gguf, conversions, tmp_path, caplog):
    src = resolve_model_path(smollm2_gguf)
    ref = load_tokenizer(src)
    (entry,) = entries(str(tmp_path / "cache"))
    backend = tmp_path / "cache" / "tokenizers" / entry / tokenizer_cache.BACKEND_FILE
    backend.write_text(backend.read_text()[:1000])  # cut short, as by a full disk
    with caplog.at_level(logging.WARNING, logger="armserve.model_loader.tokenizer_cache"):
        tok = load_tokenizer(src)
    assert "did not load" in caplog.text and len(conversions) == 2
    assert_same_tokenizer(tok, ref)
    assert len(backend.read_text()) > 1000  # cached again, whole
    assert_same_tokenizer(load_tokenizer(src), ref)
    assert len(conversions) == 2


def test_a_tokenizer_that_does_not_reload_the_same_is_never_read_back(smollm2_gguf, conversions, tmp_path,
                                                                       monkeypatch):
    calls = iter(range(1000))
    real = tokenizer_cache._fingerprint
    # the reload differs from the conversion (as a class that rebuilds its backend would)
    monkeypatch.setattr(tokenizer_cache, "_fingerprint", lambda tok: {**real(tok), "call": next(calls)})
    src = resolve_model_path(smollm2_gguf)
    ref = load_tokenizer(src)
    (entry,) = entries(str(tmp_path / "cache"))
    folder = tmp_path / "cache" / "tokenizers" / entry
    assert sorted(os.listdir(folder)) == [tokenizer_cache.META_FILE]  # a mark, no vocabulary kept
    assert json.loads((folder / tokenizer_cache.META_FILE).read_text())["usable"] is False
    monkeypatch.setattr(tokenizer_cache, "_fingerprint", real)
    assert_same_tokenizer(load_tokenizer(src), ref)
    assert len(conversions) == 2 and sorted(os.listdir(folder)) == [tokenizer_cache.META_FILE]


def test_an_unwritable_cache_only_costs_the_conversion(smollm2_gguf, conversions, tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("ARMSERVE_CACHE_ROOT", str(blocker))
    src = resolve_model_path(smollm2_gguf)
    first = load_tokenizer(src)
    assert_same_tokenizer(load_tokenizer(src), first)
    assert len(conversions) == 2


def test_a_changed_file_is_a_new_entry(tmp_path):
    f = tmp_path / "model.gguf"
    f.write_bytes(b"GGUF" + bytes(60))
    before = tokenizer_cache._key(str(f))
    assert tokenizer_cache._key(str(f)) == before
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert tokenizer_cache._key(str(f)) != before
    f.write_bytes(b"GGUF" + bytes(61))
    assert tokenizer_cache._key(str(f)) != before
