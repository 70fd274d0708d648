"""Pure parts of the server stack: the reasoning parser, the merging of delta outputs, and the large-body
worker sharing the event loop's tokenizer."""

from __future__ import annotations

import pytest

from armserve.engine.request_stream import merge_delta_outputs
from armserve.entrypoints.reasoning import ReasoningParser
from armserve.outputs import CompletionOutput, Logprob, RequestOutput

CASES = [
    # (parser, text, reasoning, content)
    ("deepseek_r1", "<think>\nplan</think>\n\nAnswer", "\nplan", "Answer"),
    ("deepseek_r1", "plan it</think>Answer", "plan it", "Answer"),  # <think> was in the prompt
    ("deepseek_r1", "still thinking", "still thinking", None),
    ("qwen3", "<think>plan</think>Answer", "plan", "Answer"),
    ("qwen3", "Just an answer", None, "Just an answer"),
    ("qwen3", "a </think> b", None, "a </think> b"),
    ("qwen3", "", None, None),
]


@pytest.mark.parametrize("name,text,reasoning,content", CASES)
def test_reasoning_parser_whole_and_streamed(name, text, reasoning, content):
    assert ReasoningParser(name).parse(text) == (reasoning, content)
    # Streamed one character at a time (tags split across deltas) gives the same split.
    p = ReasoningParser(name)
    r = c = ""
    for ch in text:
        dr, dc = p.feed(ch)
        r, c = r + dr, c + dc
    dr, dc = p.finish()
    assert ((r + dr) or None, (c + dc) or None) == (reasoning, content)


def test_reasoning_parser_rejects_unknown_name():
    with pytest.raises(ValueError, match="unknown reasoning parser 'nope'"):
        ReasoningParser("nope")


def _out(index: int, text: str, ids: list[int], finish: str | None, finished: bool) -> RequestOutput:
    lps = [{t: Logprob(-1.0, 1, str(t))} for t in ids]
    return RequestOutput("r", None, [1], None, [CompletionOutput(index, text, ids, -1.0, lps, finish)], finished)


def test_merge_delta_outputs_concatenates_per_completion():
    a = _out(0, "Hel", [5], None, False)
    b = _out(0, "lo", [6], None, False)
    b.outputs.append(CompletionOutput(1, "x", [9], None, None, None))
    c = _out(0, "!", [7], "stop", True)
    m = merge_delta_outputs(merge_delta_outputs(a, b), c)
    assert [o.index for o in m.outputs] == [0, 1]
    first = m.outputs[0]
    assert first.text == "Hello!" and first.token_ids == [5, 6, 7] and len(first.logprobs) == 3
    assert first.finish_reason == "stop" and m.finished
    assert m.outputs[1].text == "x"
    assert a.outputs[0].text == "Hel" and a.outputs[0].token_ids == [5]  # inputs untouched


# ---- the large-body worker shares the event loop's tokenizer ---------------------------------


def _serving(tokenizer, pooling: bool = False):
    from types import SimpleNamespace

    from armserve.entrypoints.serving import OpenAIServing

    engine = SimpleNamespace(tokenizer=tokenizer, config=SimpleNamespace(model="m", generation_config="vllm"),
                             input_processor=SimpleNamespace(pooler=object() if pooling else None))
    return OpenAIServing(engine, ["m"])  # type: ignore[arg-type]


class _Raw:
    """A request as `prepare` sees it: only its content-length."""

    def __init__(self, size: int) -> None:
        self.headers = {"content-length": str(size)}


@pytest.mark.needs_model
def test_a_small_request_is_tokenized_while_a_huge_one_is_on_the_worker(tokenizer_dir):
    """The worker encodes with the event loop's own tokenizer (no second copy: ~40 MiB of the front
    end), and the loop still tokenizes small requests meanwhile: the Rust encode_batch that
    transformers calls releases the GIL. (With the GIL held, as the Rust tokenizer's plain `encode`
    holds it, ~60 small requests got through here while 2.6 MB was encoded, against ~26,000.)"""
    import asyncio
    import threading

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    reference = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.backend_tokenizer.enable_truncation(8)  # (state a tokenizer.json may bring, which an encode would reset)
    tok.backend_tokenizer.enable_padding()
    serving = _serving(tok)
    assert serving._prep_tokenizer is tok
    # set off once, before the threads share it: no encode changes it any more
    assert tok.backend_tokenizer.truncation is None and tok.backend_tokenizer.padding is None
    huge = "All work and no play makes Jack a dull boy. " * 60_000  # 2.6 MB, seconds to encode
    small = ["Hello there, how are you?", "The capital of France is", "def f(x): return x * 2"]
    started = threading.Event()

    def encode_huge(t):
        assert t is tok  # the shared one
        started.set()
        return t.encode(huge, add_special_tokens=False)

    async def run():
        big = asyncio.ensure_future(serving.prepare(_Raw(len(huge)), encode_huge))
        while not started.is_set():
            await asyncio.sleep(0.001)
        done_meanwhile = []
        while not big.done() and len(done_meanwhile) < 1000:
            text = small[len(done_meanwhile) % len(small)]
            done_meanwhile.append((text, await serving.prepare(_Raw(len(text)), lambda t: t.encode(text))))
            await asyncio.sleep(0)
        return done_meanwhile, big.done(), await big

    done_meanwhile, big_done, big_ids = asyncio.run(run())
    assert not big_done and len(done_meanwhile) == 1000, f"{len(done_meanwhile)} small requests got through"
    for text, ids in done_meanwhile:
        assert ids == reference.encode(text)
    assert big_ids == reference.encode(huge, add_special_tokens=False)
    serving._prep_pool.shutdown()


@pytest.mark.needs_model
def test_a_pooling_models_worker_keeps_its_own_tokenizer(tokenizer_dir):
    """A pooling model truncates its inputs through the tokenizer's Rust state (which another thread's
    encode would see, and which cannot change while one encodes): its worker has a copy."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    serving = _serving(tok, pooling=True)
    serving._prep_ready.result()
    assert serving._prep_tokenizer is not tok
    assert serving._prep_tokenizer.encode("Hello there") == tok.encode("Hello there")
    serving._prep_pool.shutdown()


@pytest.mark.parametrize("shape", ["300k messages", "1M token ids"])
def test_a_large_body_is_parsed_letting_other_threads_run(shape):
    """A large body's JSON parse (on the tokenize worker) lets the event loop's thread in while it
    runs: json.loads alone holds the interpreter lock for the whole parse (~100 ms for 10 MB of
    300k messages), so /health waited on it. Counted, not timed: how often the main thread got to
    run while the worker parsed (without the hooks: at most the handover at each end)."""
    import json
    import threading

    from armserve.entrypoints.serving import decode_json

    body = {"messages": [{"role": "user", "content": "hi"}] * 300_000} if shape == "300k messages" else \
        {"model": "m", "prompt": list(range(1_000_000))}
    data = json.dumps(body).encode()
    started, done, out = threading.Event(), threading.Event(), []

    def parse() -> None:
        started.set()
        out.append(decode_json(data))
        done.set()

    worker = threading.Thread(target=parse)
    worker.start()
    started.wait()
    turns = 0
    while not done.is_set():
        turns += 1
        threading.Event().wait(0.001)  # (hands the lock over, as the event loop's select does)
    worker.join()
    assert out[0] == body  # the same value as json.loads makes
    assert type(out[0]) is dict and out[0] == json.loads(data)
    assert turns >= 5, f"the main thread ran {turns} times during the parse"


def test_a_large_bodys_json_is_read_as_json_loads_reads_it():
    """Duplicate keys (the last wins), big and negative integers, floats, nesting, unicode; and the
    same errors (malformed JSON, an integer past Python's 4300-digit limit)."""
    import json

    from armserve.entrypoints.serving import OFF_LOOP_BODY_BYTES, decode_json

    pad = "x" * OFF_LOOP_BODY_BYTES
    text = ('{"a": 1, "a": 2, "n": [-5, 0, 12345678901234567890, 1.5, -2e-3, true, null], '
            '"s": "caf\\u00e9 \\ud83d\\ude00", "o": {"p": {"q": []}}, "pad": "%s"}' % pad)
    assert decode_json(text.encode()) == json.loads(text)
    assert decode_json(text.encode())["a"] == 2
    for bad in ('{"a": ' + "9" * 5000 + ', "pad": "%s"}' % pad, '{"pad": "%s", ' % pad):
        with pytest.raises(ValueError):
            json.loads(bad)
        with pytest.raises(ValueError):
            decode_json(bad.encode())


def test_unsupported_fields_are_logged_in_a_bounded_line(caplog):
    """A body with 50k unknown keys (one of them a megabyte long) logs one short warning that names
    a few of them and counts the rest; a couple of unknown keys are all named."""
    from armserve.entrypoints.protocol import IGNORED_FIELDS_SHOWN, ChatCompletionRequest

    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    body = ChatCompletionRequest.model_validate({**base, **{f"x{i:05d}": i for i in range(50_000)}, "a" * 2**20: 1})
    with caplog.at_level("WARNING", logger="armserve"):
        body.warn_ignored_fields()
    (record,) = [r for r in caplog.records if "unsupported request field" in r.getMessage()]
    line = record.getMessage()
    assert len(line) < 1500, len(line)
    assert f"and {50_001 - IGNORED_FIELDS_SHOWN} more" in line and "aaa..." in line
    caplog.clear()
    with caplog.at_level("WARNING", logger="armserve"):
        ChatCompletionRequest.model_validate({**base, "foo": 1, "bar": 2}).warn_ignored_fields()
    assert "ignoring unsupported request field(s): bar, foo" in caplog.text and "more" not in caplog.text
