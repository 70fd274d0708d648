"""The tool-call parsers on text: single and multiple calls, text before calls, malformed output
(plain text, no calls), and the streaming split of content from a call."""

from __future__ import annotations

import json

import pytest

from armserve.entrypoints.tool_parsers import TOOL_PARSERS, ToolCallStream, get_tool_parser


def calls_of(parser: str, text: str) -> tuple[str | None, list[tuple[str, dict]]]:
    content, calls = get_tool_parser(parser).extract(text)
    assert all(c.id.startswith("call_") for c in calls)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


PARIS = ("get_weather", {"city": "Paris"})
ADD = ("add", {"a": 1, "b": 2.5})

CASES = {
    "hermes": [
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', None, [PARIS]),
        ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2.5}}\n</tool_call>', "Let me check.", [PARIS, ADD]),
        # no closing tag (stopped at EOS right after the JSON)
        ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}', None, [PARIS]),
        ('<tool_call>{"name": "get_weather", "arguments": {"city": "Par', "MALFORMED", []),
        ("The weather in Paris is sunny.", "The weather in Paris is sunny.", []),
        # the tags left out (Qwen2.5-Coder-0.5B): only a reply that is exactly such an object
        ('{"name": "get_weather", "arguments": {"city": "Paris"}}', None, [PARIS]),
        ('{"name": "Ada", "age": 36}', "MALFORMED", []),
        ('Call {"name": "get_weather", "arguments": {}} now', "MALFORMED", []),
        # ... or alone in a json fence (the same model, at a near tie between `{"` and a fence)
        ('```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```', None, [PARIS]),
        ('```\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```\n', None, [PARIS]),
        ('```json\n{"name": "Ada", "age": 36}\n```', "MALFORMED", []),
        ('```python\nprint(1)\n```', "MALFORMED", []),
    ],
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [PARIS]),
        ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
         '{"name": "add", "parameters": {"a": 1, "b": 2.5}}', None, [PARIS, ADD]),
        ('[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "add", "arguments": {"a": 1, "b": 2.5}}]',
         None, [PARIS, ADD]),
        ('{"name": "get_weather", "parameters": {"city": ', "MALFORMED", []),
        ('{"city": "Paris"}', "MALFORMED", []),  # JSON, but no function call
        ("Sure: it is sunny.", "Sure: it is sunny.", []),
    ],
    "mistral": [
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', None, [PARIS]),
        ('I will call two tools. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
         '{"name": "add", "arguments": {"a": 1, "b": 2.5}}]', "I will call two tools.", [PARIS, ADD]),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2.5}', None, [PARIS, ADD]),
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city"', "MALFORMED", []),
        ("No tools needed.", "No tools needed.", []),
    ],
    "pythonic": [
        ('[get_weather(city="Paris")]', None, [PARIS]),
        ("[get_weather(city='Paris'), add(a=1, b=2.5)]", None, [PARIS, ADD]),
        ('<|python_start|>[get_weather(city="Paris")]<|python_end|>', None, [PARIS]),
        ('[get_weather(city="Paris"', "MALFORMED", []),
        ("[get_weather(__import__('os'))]", "MALFORMED", []),  # positional / non-literal: text
        ("[1, 2, 3]", "MALFORMED", []),
        ("Paris is in France.", "Paris is in France.", []),
    ],
}


@pytest.mark.parametrize("parser", sorted(TOOL_PARSERS))
def test_parser_cases(parser):
    for text, content, calls in CASES[parser]:
        got_content, got_calls = calls_of(parser, text)
        assert got_calls == calls, (parser, text)
        assert got_content == (text if content == "MALFORMED" else content), (parser, text)


def test_unknown_parser_names_the_choices():
    with pytest.raises(ValueError, match="unknown tool call parser 'nope'; choose from hermes"):
        get_tool_parser("nope")


def reassemble(deltas: list[tuple[str, list[dict]]]) -> tuple[str, list[dict]]:
    """Content and calls as the OpenAI SDK puts deltas together (by index)."""
    content, calls = "", {}
    for text, parts in deltas:
        content += text
        for p in parts:
            call = calls.setdefault(p["index"], {"id": None, "name": None, "arguments": ""})
            call["id"] = p.get("id", call["id"])
            call["name"] = p.get("function", {}).get("name", call["name"])
            call["arguments"] += p["function"].get("arguments", "")
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("parser,text", [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
    ("hermes", "No call here, just <tool text."),
    ("hermes", '{"name": "get_weather", "arguments": {"city": "Paris"}}'),
    ("hermes", '{"name": "Ada"}'),
    ("hermes", '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```'),
    ("hermes", '```python\nprint("a fence of code streams at once")\n```'),
    ("pythonic", '[get_weather(city="Paris"), add(a=1, b=2.5)]'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}'),
    ("mistral", 'Ok [TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2.5}}]'),
])
def test_streamed_deltas_reassemble_to_the_whole_parse(parser, text):
    whole_content, whole_calls = get_tool_parser(parser).extract(text)
    ts = ToolCallStream("auto", get_tool_parser(parser), None)
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
    deltas = [ts.feed(p, final=False) for p in pieces] + [ts.feed("", final=True)]
    content, calls = reassemble(deltas)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == \
        [(c.name, json.loads(c.arguments)) for c in whole_calls]
    assert content.strip() == (whole_content or "").strip()
    # nothing of a call leaks into the content before the end
    if whole_calls:
        early = "".join(d[0] for d in deltas[:-1])
        assert text.startswith(early) and len(early) <= get_tool_parser(parser).call_start(text)


def test_named_and_required_streams():
    ts = ToolCallStream("named", None, "get_weather")
    deltas = [ts.feed('{"city": ', False), ts.feed('"Paris"}', False), ts.feed("", True)]
    content, calls = reassemble(deltas)
    assert content == "" and calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"]) == PARIS[1]
    assert deltas[0][1][0]["function"] == {"name": "get_weather", "arguments": ""}  # name first
    ts = ToolCallStream("required", None, None)
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "add", "parameters": {"a": 1, "b": 2.5}}]'
    content, calls = reassemble([ts.feed(text[:10], False), ts.feed(text[10:], False), ts.feed("", True)])
    assert content == "" and [(c["name"], json.loads(c["arguments"])) for c in calls] == [PARIS, ADD]


def test_hermes_holds_back_only_what_may_become_a_bare_call():
    p = get_tool_parser("hermes")
    for text in ("`", "``", "```", "```js", "```json", "```json\n", "```json\n{", "```\n{\"na", "  {\"name"):
        assert p.call_start(text) == len(text) - len(text.lstrip()), text  # held: may still be a call
    for text in ("```python\nprint(1)", "```py", "```json\nhello", "Sure, here", "`x`"):
        assert p.call_start(text) == len(text), text  # streams: cannot become a call any more
