"""Tool-call parsers (`--tool-call-parser NAME`): find the function calls in a model's text.

Each parser knows one family's output format:

    hermes       Qwen2.5 / Qwen3, Hermes:  text <tool_call>{"name": .., "arguments": {..}}</tool_call> ...
                                          (or a reply that is only that JSON object, tags left out)
    llama3_json  Llama 3.x:               {"name": .., "parameters": {..}}  (several joined by ";")
    mistral      Mistral:                 text [TOOL_CALLS][{"name": .., "arguments": {..}}, ...]
    pythonic     Llama 3.2/4, ToolACE:    [get_weather(city="Paris"), add(a=1, b=2)]

`extract(text)` -> (content, calls). Output that does not parse as that format is plain text
(no calls), never an error. For streaming, `call_start(text)` says where a call may begin, so
the text before it can be sent as content while the rest is held back; `ToolCallStream` does that
for one choice of a response.
"""

from __future__ import annotations

import ast
import json
import re
import uuid

import regex
from dataclasses import dataclass, field
from typing import Any

from armserve.entrypoints.reasoning import partial_suffix


@dataclass
class ToolCall:
    """One function call; `arguments` is JSON text, as OpenAI's API carries it."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _call_from_dict(d: object, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> ToolCall:
    """{"name": ..., "arguments"|"parameters": {...}} -> ToolCall; ValueError if it is not one."""
    if not isinstance(d, dict) or not isinstance(d.get("name"), str) or not d["name"]:
        raise ValueError("not a function call")
    args = next((d[k] for k in args_keys if k in d), {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        args = json.loads(args)
    if not isinstance(args, dict):
        raise ValueError("arguments are not an object")
    return ToolCall(d["name"], json.dumps(args, ensure_ascii=False))


class ToolParser:
    """Base: a format whose calls follow a marker somewhere in the text."""

    name = ""
    marker = ""

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        raise NotImplementedError

    def call_start(self, text: str) -> int:
        """Index from which `text` may be (the start of) a tool call; len(text) if none."""
        i = text.find(self.marker)
        if i >= 0:
            return i
        return len(text) - partial_suffix(text, self.marker)


def _content(text: str) -> str | None:
    text = text.strip()
    return text or None


class HermesToolParser(ToolParser):
    name = "hermes"
    marker = "<tool_call>"
    _CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        i = text.find(self.marker)
        if i < 0:
            call = self._bare_call(text)
            return (None, [call]) if call is not None else (text, [])
        try:
            calls = [_call_from_dict(json.loads(body.strip())) for body in self._CALL.findall(text[i:])]
        except ValueError:
            return text, []
        return _content(text[:i]), calls

    _FENCED = re.compile(r"```(?:json)?[ \t]*\n(.*?)\n?[ \t]*```", re.DOTALL)

    @classmethod
    def _bare_call(cls, text: str) -> ToolCall | None:
        """A reply that is nothing but `{"name": .., "arguments": {..}}`, without the tags, or that
        object alone in a ```json fence: small Qwen models (Qwen2.5-Coder-0.5B) answer so; no
        other reply has that exact shape."""
        body = text.strip()
        fenced = cls._FENCED.fullmatch(body)
        if fenced:
            body = fenced.group(1).strip()
        if not (body.startswith("{") and body.endswith("}")):
            return None
        try:
            d = json.loads(body)
            return _call_from_dict(d, ("arguments",)) if isinstance(d, dict) and set(d) == {"name", "arguments"} \
                else None
        except ValueError:
            return None

    # What a reply that is a fenced bare call starts with (a fence of any other language streams at once).
    _FENCED_START = regex.compile(r"```(?:json)?[ \t\n]*\{.*", regex.DOTALL)

    def call_start(self, text: str) -> int:
        stripped = text.lstrip()
        # partial: the reply so far can still become one
        if stripped.startswith("{") or (stripped and self._FENCED_START.fullmatch(stripped, partial=True)):
            return len(text) - len(stripped)  # maybe a bare call: hold it back until the end decides
        return super().call_start(text)


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    marker = "<|python_tag|>"

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip().removeprefix(self.marker).strip()
        if not body.startswith(("{", "[")):
            return text, []
        try:
            try:
                parsed = json.loads(body)
                items = parsed if isinstance(parsed, list) else [parsed]
            except ValueError:
                items = [json.loads(part) for part in re.split(r"\s*;\s*(?=\{)", body)]
            return None, [_call_from_dict(d) for d in items]
        except ValueError:
            return text, []

    def call_start(self, text: str) -> int:
        # A call is the whole reply: it starts at the first non-space character, if that is `{`.
        stripped = text.lstrip()
        if not stripped or stripped.startswith(("{", "[")) or self.marker.startswith(stripped[: len(self.marker)]):
            return len(text) - len(stripped)
        return len(text)


class MistralToolParser(ToolParser):
    name = "mistral"
    marker = "[TOOL_CALLS]"
    # Newer Mistral templates: [TOOL_CALLS]name[ARGS]{...} per call.
    _V11 = re.compile(r"\[TOOL_CALLS\]\s*([A-Za-z0-9_.\-]+)\s*\[ARGS\]")

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        i = text.find(self.marker)
        if i < 0:
            return text, []
        body = text[i:]
        try:
            if self._V11.match(body):
                parts = self._V11.split(body)  # ["", name1, args1, name2, args2, ...]
                calls = [ToolCall(n, json.dumps(json.loads(a), ensure_ascii=False))
                         for n, a in zip(parts[1::2], parts[2::2])]
            else:
                arr = json.loads(body[len(self.marker):].strip())
                calls = [_call_from_dict(d) for d in (arr if isinstance(arr, list) else [arr])]
        except ValueError:
            return text, []
        return _content(text[:i]), calls


class PythonicToolParser(ToolParser):
    name = "pythonic"
    marker = "["

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip().removeprefix("<|python_start|>").removesuffix("<|python_end|>").strip()
        if not (body.startswith("[") and body.endswith("]")):
            return text, []
        try:
            tree = ast.parse(body, mode="eval").body
            if not isinstance(tree, ast.List) or not tree.elts:
                raise ValueError("not a list of calls")
            calls = []
            for node in tree.elts:
                if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                    raise ValueError("not a call with keyword arguments")
                args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
                calls.append(ToolCall(node.func.id, json.dumps(args, ensure_ascii=False)))
        except (SyntaxError, ValueError):
            return text, []
        return None, calls

    def call_start(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped or stripped.startswith("[") or "<|python_start|>".startswith(stripped[:16]):
            return len(text) - len(stripped)
        return len(text)


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser)
}


def get_tool_parser(name: str) -> ToolParser:
    """The parser registered as `name`; ValueError listing the choices otherwise."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; choose from {', '.join(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]()


class ToolCallStream:
    """One choice's tool calls, whole (`extract`) or as streamed deltas (`feed`).

    "named": the text is the forced function's arguments (the grammar makes it that object), so
    its deltas stream as argument fragments after a first delta with the call's id and name.
    "required": the text is `[{"name": .., "parameters": {..}}, ...]`; held back to the end.
    "auto": the parser's format; text before a possible call streams as content, the rest is
    held back until the end and then parsed (text that is no call goes out as content).
    """

    def __init__(self, mode: str, parser: ToolParser | None, forced_name: str | None) -> None:
        self.mode = mode
        self.parser = parser
        self.forced_name = forced_name
        self.text = ""
        self.sent = 0  # characters of `text` sent as content
        self.called = False
        self._named_call: ToolCall | None = None

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole completion's text."""
        if self.mode == "named":
            try:
                args = json.loads(text)
            except ValueError:
                return text, []  # cut short (max_tokens): give the text back as it is
            return None, [ToolCall(self.forced_name, json.dumps(args, ensure_ascii=False))]  # type: ignore[arg-type]
        if self.mode == "required":
            try:
                items = json.loads(text)
                return None, [ToolCall(d["name"], json.dumps(d["parameters"], ensure_ascii=False)) for d in items]
            except (ValueError, KeyError, TypeError):
                return text, []
        assert self.parser is not None
        return self.parser.extract(text)

    def feed(self, delta: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """(content delta, tool-call deltas) to send for this text delta."""
        self.text += delta
        if self.mode == "named":
            out = []
            if self._named_call is None and (delta or final):
                self._named_call = ToolCall(self.forced_name, "")  # type: ignore[arg-type]
                self.called = True
                out.append({"index": 0, "id": self._named_call.id, "type": "function",
                            "function": {"name": self.forced_name, "arguments": ""}})
            if delta:
                out.append({"index": 0, "function": {"arguments": delta}})
            return "", out
        if not final:
            if self.mode == "required":
                return "", []
            assert self.parser is not None
            start = max(self.parser.call_start(self.text), self.sent)
            content, self.sent = self.text[self.sent:start], start
            return content, []
        content, calls = self.extract(self.text)
        if not calls:
            rest, self.sent = self.text[self.sent:], len(self.text)
            return rest, []
        self.called = True
        start = self.parser.call_start(self.text) if self.parser is not None else self.sent
        rest = self.text[self.sent:max(start, self.sent)].rstrip() if content else ""
        out = []
        for i, call in enumerate(calls):
            out.append({"index": i, "id": call.id, "type": "function",
                        "function": {"name": call.name, "arguments": ""}})
            out.append({"index": i, "function": {"arguments": call.arguments}})
        return rest, out
