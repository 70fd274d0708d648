"""Pure parts of the server stack: the reasoning parser and the merging of delta outputs."""

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
