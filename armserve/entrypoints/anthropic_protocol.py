"""Request bodies of Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`), their
mapping onto the equivalent chat request, and Anthropic's error shape.

A Messages request is served as the chat request it stands for (`to_chat_request`): the system
prompt becomes a system message, `tool_use` / `tool_result` blocks become assistant tool calls and
tool messages, `input_schema` tools become function tools, `tool_choice` auto/any/tool/none become
chat's auto/required/named/none, `output_config.format` becomes a JSON-schema response_format;
the chat request's own validation then applies.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, model_validator

from armserve.entrypoints.protocol import APIError, ChatCompletionRequest, OpenAIBaseModel

# Paths whose errors go out in Anthropic's shape instead of OpenAI's.
ANTHROPIC_PATHS = ("/v1/messages",)

# Anthropic's error type per HTTP status (its API docs, "Errors"); other 4xx are invalid_request_error.
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error"}


def is_anthropic_path(path: str) -> bool:
    return path.startswith(ANTHROPIC_PATHS)


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    """`{"type": "error", "error": {"type": ..., "message": ...}}`, as Anthropic's API answers."""
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_body(path: str, err: APIError) -> dict[str, Any]:
    """An error's JSON body in the shape the route's clients expect (Anthropic's or OpenAI's)."""
    return anthropic_error_body(err.status, err.message) if is_anthropic_path(path) else err.body()


class AnthropicTool(OpenAIBaseModel):
    """A client tool: a name, a description and the JSON schema of its input."""

    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any] | None = None  # required; checked below so a server tool gets its own message
    type: str | None = None  # "custom", or absent

    @model_validator(mode="after")
    def _client_tool(self) -> "AnthropicTool":
        if self.type not in (None, "custom"):
            raise ValueError(f"tool {self.name!r}: type {self.type!r} is a server tool, which this server does not "
                             "run; give client tools (name, description, input_schema)")
        if self.input_schema is None:
            raise ValueError(f"tool {self.name!r} needs an input_schema")
        return self


class AnthropicToolChoice(OpenAIBaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class AnthropicMessage(OpenAIBaseModel):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


def _text_of(content: Any, where: str) -> str:
    """The text of a string or of a list of text blocks (a system prompt, a tool result)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where} must be a string or a list of text blocks")
    parts = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text" or not isinstance(block.get("text"), str):
            raise ValueError(_unsupported_block(kind, f"{where}[{j}]"))
        parts.append(block["text"])
    return "\n".join(parts)


def _unsupported_block(kind: Any, where: str) -> str:
    if kind == "text":
        return f"{where}: a text block needs a 'text' string"
    if kind in ("image", "document"):
        return (f"{where}: {kind} content blocks are not supported: this server serves a text-only model "
                "(send text blocks)")
    return f"{where}: content block type {kind!r} is not supported (text, tool_use and tool_result are)"


def _chat_messages(system: str | list[dict[str, Any]] | None, messages: list[AnthropicMessage]) -> list[dict[str, Any]]:
    """Anthropic's system prompt and messages as chat messages (ValueError naming a bad block).

    A user turn's tool_result blocks become tool messages (before its text, as Anthropic orders
    them); an assistant turn's tool_use blocks become its tool_calls; thinking blocks are dropped."""
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": _text_of(system, "system")})
    for i, m in enumerate(messages):
        where = f"messages[{i}].content"
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        results = 0
        for j, block in enumerate(m.content):
            kind = block.get("type") if isinstance(block, dict) else None
            at = f"{where}[{j}]"
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind == "tool_result" and m.role == "user":
                if not isinstance(block.get("tool_use_id"), str):
                    raise ValueError(f"{at}: tool_result needs a tool_use_id")
                result = _text_of(block.get("content") or "", f"{at}.content")
                if block.get("is_error"):
                    result = f"Error: {result}"
                out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": result})
                results += 1
            elif kind == "tool_use" and m.role == "assistant":
                if not isinstance(block.get("name"), str) or not isinstance(block.get("input", {}), dict):
                    raise ValueError(f"{at}: tool_use needs a name and an input object")
                calls.append({"id": block.get("id"), "type": "function",
                              "function": {"name": block["name"], "arguments": json.dumps(block.get("input", {}))}})
            elif kind in ("thinking", "redacted_thinking") and m.role == "assistant":
                continue
            elif kind in ("tool_use", "tool_result"):
                raise ValueError(f"{at}: {kind} blocks belong in {'assistant' if kind == 'tool_use' else 'user'} "
                                 "messages")
            else:
                raise ValueError(_unsupported_block(kind, at))
        if calls:
            out.append({"role": "assistant", "content": "\n".join(texts) or None, "tool_calls": calls})
        elif texts or not results:
            out.append({"role": m.role, "content": "\n".join(texts)})
    return out


class CountTokensRequest(OpenAIBaseModel):
    """POST /v1/messages/count_tokens: a Messages request without max_tokens."""

    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None

    @model_validator(mode="after")
    def _check_tool_choice(self) -> "CountTokensRequest":
        choice = self.tool_choice
        if choice is not None and choice.type == "tool":
            names = [t.name for t in self.tools or []]
            if choice.name not in names:
                raise ValueError(f"tool_choice names the tool {choice.name!r}, which is not among the tools "
                                 f"({', '.join(names) or 'none given'})")
        elif choice is not None and choice.type == "any" and not self.tools:
            raise ValueError('tool_choice "any" needs tools')
        return self

    def chat_tools(self) -> list[dict[str, Any]] | None:
        """The tools as chat function tools."""
        if not self.tools:
            return None
        return [{"type": "function", "function": {"name": t.name, "parameters": t.input_schema,
                                                  **({"description": t.description} if t.description else {})}}
                for t in self.tools]

    def chat_messages(self) -> list[dict[str, Any]]:
        return _chat_messages(self.system, self.messages)


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages (Anthropic's Messages API)."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None
    # Structured outputs: {"format": {"type": "json_schema", "schema": {...}}} (its `effort` is ignored).
    output_config: dict[str, Any] | None = None

    def to_chat_request(self) -> ChatCompletionRequest:
        """The equivalent chat request (ValueError / pydantic's ValidationError on bad input)."""
        choice = self.tool_choice
        tool_choice: str | dict[str, Any] | None = None
        parallel = True
        if choice is not None:
            tool_choice = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or \
                {"type": "function", "function": {"name": choice.name}}
            parallel = not choice.disable_parallel_tool_use
        return ChatCompletionRequest(
            model=self.model, messages=self.chat_messages(), tools=self.chat_tools(), tool_choice=tool_choice,
            parallel_tool_calls=parallel, max_tokens=self.max_tokens, stop=self.stop_sequences,
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            response_format=(self.output_config or {}).get("format"))  # flat, as the Responses API's
