"""Request bodies of the OpenAI-compatible API (pydantic), and their mapping to `SamplingParams`.

Field names follow OpenAI's API plus vLLM's extra sampling fields (`top_k`, `min_p`,
`repetition_penalty`, `ignore_eos`, ...). Unknown fields are accepted and ignored (with a log
line), as in vLLM, so newer clients keep working.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from armserve.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger("armserve")

_SEED_MIN, _SEED_MAX = -(2**63), 2**63 - 1  # torch generators take 64-bit seeds; n > 1 adds i


class APIError(Exception):
    """An error returned to the client in OpenAI's JSON shape."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             405: "invalid_request_error", 408: "timeout_error", 413: "invalid_request_error",
             429: "rate_limit_error", 500: "internal_server_error", 503: "service_unavailable",
             504: "timeout_error"}

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "api_error"),
                          "param": self.param, "code": self.code}}


IGNORED_FIELDS_SHOWN = 10  # names of unsupported fields a request's warning lists


class OpenAIBaseModel(BaseModel):
    # NOTE: strict, as OpenAI's API is: a value of the wrong JSON type is a 400 naming the field, not
    # coerced (pydantic's default lax mode took `"store": 0` as false, `"top_k": false` as 0, a
    # `[[false]]` prompt as token id 0 and `"16"` as 16). Floats take integers; integers take no
    # floats, not even 16.0 (OpenAI's "expected an integer, but got a decimal number").
    model_config = ConfigDict(extra="allow", strict=True)

    def warn_ignored_fields(self) -> None:
        """Log the request's fields this server does not read: a few names, each cut short (a body
        of 300k unknown keys, or one key of megabytes, would otherwise be a log line of megabytes
        per request)."""
        if self.model_extra:
            names = sorted(self.model_extra)
            shown = ", ".join(n if len(n) <= 64 else n[:61] + "..." for n in names[:IGNORED_FIELDS_SHOWN])
            more = f" and {len(names) - IGNORED_FIELDS_SHOWN} more" if len(names) > IGNORED_FIELDS_SHOWN else ""
            logger.warning("ignoring unsupported request field(s): %s%s", shown, more)


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk


class ChatMessage(OpenAIBaseModel):
    """A message; roles and text are checked where it is rendered (armserve/prompts.py)."""

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # role "tool": which call this answers


class FunctionDefinition(OpenAIBaseModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


def tool_parameters(fn: FunctionDefinition) -> dict[str, Any]:
    """A function's parameter schema (an empty object when it declares none)."""
    return fn.parameters or {"type": "object", "properties": {}}


def structured_from_response_format(rf: dict[str, Any] | None) -> StructuredOutputsParams | None:
    """OpenAI's response_format (chat) / text.format (responses) as StructuredOutputsParams."""
    if not rf:
        return None
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        # Chat nests the schema under json_schema; the Responses API's text.format is flat.
        spec = rf.get("json_schema", rf)
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ValueError("response_format: json_schema needs a 'schema' object")
        return StructuredOutputsParams(json=schema)
    raise ValueError(f"response_format: type {kind!r} is not supported; use text, json_object or json_schema")


# Request fields that are SamplingParams fields of the same name and meaning.
_PASSED_TO_SAMPLING = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                       "repetition_penalty", "min_tokens", "stop", "stop_token_ids", "ignore_eos",
                       "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens")


class _SamplingFields(OpenAIBaseModel):
    """Sampling fields shared by chat and completions."""

    model: str | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    max_tokens: int | None = None
    n: int = Field(1, ge=1, le=128)
    seed: int | None = Field(None, ge=_SEED_MIN, le=_SEED_MAX)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    # vLLM's extra sampling parameters.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_*.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @model_validator(mode="after")
    def _check_common(self) -> "_SamplingFields":
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported by this server")
        self.structured()  # a malformed constraint is a 400 naming its field
        return self

    def structured(self) -> StructuredOutputsParams | None:
        """The one output constraint the body asks for, if any (ValueError if it asks for two)."""
        found: list[tuple[str, StructuredOutputsParams]] = []
        rf = structured_from_response_format(self.response_format)
        if rf is not None:
            found.append(("response_format", rf))
        if self.structured_outputs:
            try:
                found.append(("structured_outputs", StructuredOutputsParams(**self.structured_outputs)))
            except TypeError as e:
                raise ValueError(f"structured_outputs: {e}") from None
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                          ("guided_grammar", "grammar")):
            value = getattr(self, name)
            if value is not None:
                found.append((name, StructuredOutputsParams(**{key: value})))
        if len(found) > 1:
            raise ValueError(f"give one output constraint, not {' and '.join(n for n, _ in found)}")
        return found[0][1] if found else None

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None,
                         prompt_logprobs: int | None = None, defaults: dict[str, Any] | None = None) -> SamplingParams:
        """Raises `SamplingParamsError` naming the bad field. A field left out or null takes `defaults`
        (the server's values, --generation-config; their max_tokens caps the request's too), else
        SamplingParams' default; max_tokens None: the engine generates up to max_model_len."""
        d = defaults or {}
        if d.get("max_tokens") is not None:
            max_tokens = d["max_tokens"] if max_tokens is None else min(max_tokens, d["max_tokens"])
        given = {f: v for f in _PASSED_TO_SAMPLING if (v := getattr(self, f)) is not None}
        given.update({f: d[f] for f in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
                      if f in d and f not in given})
        return SamplingParams(**given, max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                              structured_outputs=self.structured())


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)  # (at most --max-logprobs: the input processor checks)
    max_completion_tokens: int | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    # vLLM's chat-template controls.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_chat(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs to be true")
        choice = self.tool_choice
        if isinstance(choice, dict):
            name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
            if not isinstance(name, str):
                raise ValueError('tool_choice must be "none", "auto", "required" or '
                                 '{"type": "function", "function": {"name": ...}}')
            if not self.tools:
                raise ValueError(f"tool_choice names the function {name!r} but no tools were given")
            if name not in [t.function.name for t in self.tools]:
                raise ValueError(f"tool_choice names the function {name!r}, which is not among the tools "
                                 f"({', '.join(t.function.name for t in self.tools)})")
        elif choice == "required" and not self.tools:
            raise ValueError('tool_choice "required" needs tools')
        if self.forced_tool_schema() is not None and self.structured() is not None:
            raise ValueError("a forced tool call (tool_choice required or a named function) cannot be combined "
                             "with another output constraint")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        return self

    @property
    def effective_tool_choice(self) -> str | dict[str, Any]:
        """OpenAI's default: "auto" when tools are given, else "none"."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    @property
    def forced_function(self) -> str | None:
        """The function a named tool_choice forces, else None."""
        choice = self.tool_choice
        return choice["function"]["name"] if isinstance(choice, dict) else None

    def forced_tool_schema(self) -> dict[str, Any] | None:
        """The JSON schema that forces a call, as vLLM builds it: a named function's output is its
        arguments object; "required" writes `[{"name": ..., "parameters": {...}}, ...]`, one
        item at most unless parallel_tool_calls. None when nothing is forced."""
        if not self.tools:
            return None
        if self.forced_function is not None:
            fn = next(t.function for t in self.tools if t.function.name == self.forced_function)
            return tool_parameters(fn)
        if self.tool_choice != "required":
            return None
        items = [{"type": "object",
                  "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                 "parameters": tool_parameters(t.function)},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for t in self.tools]
        schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                  "items": items[0] if len(items) == 1 else {"anyOf": items}}
        if self.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return schema

    def to_sampling_params(self, defaults: dict[str, Any] | None = None) -> SamplingParams:
        # max_completion_tokens replaces the deprecated max_tokens (OpenAI); it wins if both are set.
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        params = self._sampling_params(max_tokens, logprobs, defaults=defaults)
        forced = self.forced_tool_schema()
        if forced is not None:
            params.structured_outputs = StructuredOutputsParams(json=forced)
        return params


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: list[int] | list[list[int]] | str | list[str]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0)
    # Fill-in-the-middle: the text after the completion (models with FIM tokens, prompts.fim_prompt).
    suffix: str | None = None
    # Generate best_of completions, return the n with the highest cumulative logprob (not streamed).
    best_of: int | None = Field(None, ge=1, le=128)
    # vLLM's: each choice also carries prompt_token_ids and token_ids.
    return_token_ids: bool = False

    @model_validator(mode="after")
    def _check_completion(self) -> "CompletionRequest":
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of must be greater than or equal to n, got n={self.n} and best_of={self.best_of}")
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise ValueError("best_of greater than n is not supported when streaming: the best completions are "
                             "known only once all have finished")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be an empty list")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list: one text or token-id list per prompt."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]

    def to_sampling_params(self, defaults: dict[str, Any] | None = None) -> SamplingParams:
        # echo with logprobs also returns the prompt's logprobs, as OpenAI's legacy API does.
        prompt_logprobs = self.logprobs if (self.echo and self.logprobs is not None) else None
        return self._sampling_params(self.max_tokens, self.logprobs, prompt_logprobs, defaults)


class ResponsesRequest(OpenAIBaseModel):
    """POST /v1/responses.

    Served by turning it into the equivalent chat request (`to_chat_request`): the stored
    conversation of `previous_response_id` (serving_responses.py), then the input items become
    messages, flat function tools become chat tools, `text.format` becomes response_format.
    """

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    previous_response_id: str | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None

    @model_validator(mode="after")
    def _check_responses(self) -> "ResponsesRequest":
        for i, t in enumerate(self.tools or []):
            if t.get("type") != "function":
                raise ValueError(f"tools[{i}]: type {t.get('type')!r} is not supported (function tools only)")
        return self

    def input_messages(self) -> list[dict[str, Any]]:
        """The input as chat messages (without the instructions); function_call /
        function_call_output items become an assistant turn with tool_calls / a tool message."""
        msgs: list[dict[str, Any]] = []
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        for i, item in enumerate(self.input):
            kind = item.get("type", "message")
            if kind == "message":
                msgs.append({"role": item.get("role"), "content": item.get("content")})
            elif kind == "function_call":
                call = {"id": item.get("call_id"), "type": "function",
                        "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
                if msgs and msgs[-1]["role"] == "assistant" and msgs[-1].get("tool_calls") is not None:
                    msgs[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
                else:
                    msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                out = item.get("output")
                msgs.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": out if isinstance(out, str) else json.dumps(out)})
            elif kind == "reasoning":
                continue
            else:
                raise ValueError(f"input[{i}]: item type {kind!r} is not supported")
        return msgs

    def to_chat_request(self, history: list[dict[str, Any]] | None = None) -> ChatCompletionRequest:
        """The equivalent chat request (its validation then applies: tools, tool_choice, formats):
        the instructions, then `history` (a stored conversation this one continues), then the input."""
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        tools = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters", "strict")
                                                   if k in t}} for t in self.tools or []]
        choice = self.tool_choice
        if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
            choice = {"type": "function", "function": {"name": choice["name"]}}
        return ChatCompletionRequest(
            model=self.model, messages=system + (history or []) + self.input_messages(), tools=tools or None,
            tool_choice=choice,
            parallel_tool_calls=self.parallel_tool_calls, max_completion_tokens=self.max_output_tokens,
            temperature=self.temperature, top_p=self.top_p,
            response_format=(self.text or {}).get("format"))


class TokenizeRequest(OpenAIBaseModel):
    """POST /tokenize: either `prompt` or chat `messages` (with `tools`, rendered as a chat request
    renders them)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ChatTool] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        if self.tools is not None and self.messages is None:
            raise ValueError("tools go with messages (a chat), not with prompt")
        return self


class DetokenizeRequest(OpenAIBaseModel):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[int]



EmbeddingInput = str | list[str] | list[int] | list[list[int]]


class EmbeddingRequest(OpenAIBaseModel):
    """POST /v1/embeddings (OpenAI's fields plus vLLM's `truncate_prompt_tokens`, `normalize`);
    also /pooling, vLLM's name for the same request."""

    model: str | None = None
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    normalize: bool | None = None
    add_special_tokens: bool = True

    def inputs(self) -> list[str | list[int]]:
        """The input(s) as a list: one text or token-id list each."""
        p = self.input
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class ScoreRequest(OpenAIBaseModel):
    """POST /score and /v1/score (vLLM's): `text_1` against `text_2` (one against many, or side
    by side); `data_1`/`data_2` are accepted for them too."""

    model: str | None = None
    text_1: str | list[str] | None = None
    text_2: str | list[str] | None = None
    data_1: str | list[str] | None = None
    data_2: str | list[str] | None = None
    truncate_prompt_tokens: int | None = None

    @model_validator(mode="after")
    def _both_sides(self) -> "ScoreRequest":
        self.text_1 = self.text_1 if self.text_1 is not None else self.data_1
        self.text_2 = self.text_2 if self.text_2 is not None else self.data_2
        if self.text_1 is None or self.text_2 is None:
            raise ValueError("give text_1 and text_2")
        return self


class RerankDocument(OpenAIBaseModel):
    text: str


class RerankRequest(OpenAIBaseModel):
    """POST /rerank, /v1/rerank, /v2/rerank (Jina's and Cohere's shape)."""

    model: str | None = None
    query: str
    documents: list[str | RerankDocument]
    top_n: int | None = Field(None, ge=0)
    return_documents: bool = True
    truncate_prompt_tokens: int | None = None

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]
