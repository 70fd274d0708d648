"""A prompt -> token ids: the one place text prompts and conversations are checked and tokenized
(used by the engine, `LLM.chat`, the server's chat, completions, responses and /tokenize routes).

Text must be encodable Unicode: JSON can carry a lone surrogate such as "\\ud800", which the
tokenizer cannot encode. Conversations arrive as OpenAI-style messages; before the chat template
sees them roles are checked, text content parts are joined, and the JSON-text arguments of
assistant `tool_calls` become dicts, as templates expect (vLLM does the same).
"""

from __future__ import annotations

import json
from typing import Any

ROLES = ("system", "developer", "user", "assistant", "tool")


class PromptError(ValueError):
    """A prompt or message cannot be tokenized; the message names it (e.g. `messages[2].role`)."""


class NoFIMError(PromptError):
    """A fill-in-the-middle prompt (a completion's `suffix`) for a model without FIM tokens."""


class PromptTooLongError(PromptError):
    """A prompt has more than `limit` tokens: at least `num_tokens` (it was not tokenized whole)."""

    def __init__(self, num_tokens: int, limit: int) -> None:
        super().__init__(f"the prompt has at least {num_tokens} tokens, more than {limit}")
        self.num_tokens = num_tokens
        self.limit = limit


# A prompt longer than this many characters per allowed token is first tokenized in part: a
# 10 MB prompt took 11 s to tokenize whole, only to be refused.
_CHARS_PER_TOKEN_CHECKED = 4


def _encode(tokenizer, text: str, add_special_tokens: bool, max_tokens: int | None) -> list[int]:
    """tokenizer.encode, or PromptTooLongError without tokenizing it all when `text` has more than
    `max_tokens` tokens by far (a start of it alone has more)."""
    if max_tokens is not None:
        # NOTE: starts of 4, 16, 64, ... x (limit + 64) characters, until one tokenizes to well over
        # the limit (the margin covers merges that differ at the cut) or the start is the whole
        # prompt: the work is bounded by the limit (times the text's characters per token), not by
        # the length of the prompt (10 MB of long words took 3 s with a single 4x start).
        n = _CHARS_PER_TOKEN_CHECKED * (max_tokens + 64)
        while n < len(text):
            head = tokenizer.encode(text[:n], add_special_tokens=add_special_tokens)
            if len(head) > max_tokens + 16:
                raise PromptTooLongError(len(head) - 16, max_tokens)
            n *= 4
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def check_text(text: str, where: str) -> str:
    """`text` if it is encodable Unicode, else a ValueError naming `where`."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PromptError(f"{where} is not valid Unicode: it holds the lone surrogate "
                        f"{text[e.start]!r} at character {e.start}") from None
    return text


def encode_text(tokenizer, text: str, where: str = "prompt", add_special_tokens: bool = True,
                max_tokens: int | None = None) -> list[int]:
    """Token ids of a text prompt; a PromptError naming `where` if it is not valid Unicode, a
    PromptTooLongError if it has more than `max_tokens` tokens (found without tokenizing it all)."""
    return _encode(tokenizer, check_text(text, where), add_special_tokens, max_tokens)


# Fill-in-the-middle markers in prefix-suffix-middle order: Qwen2.5-Coder's, then StarCoder's (the
# same layout). A model has FIM when all three of a set are tokens of its vocabulary.
FIM_TOKENS = (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"), ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"))


def fim_token_ids(tokenizer) -> tuple[int, int, int] | None:
    """(prefix, suffix, middle) token ids of the model's fill-in-the-middle markers, or None."""
    for names in FIM_TOKENS:
        ids = [tokenizer.convert_tokens_to_ids(n) for n in names]
        # (an unknown token maps to the unk id, or None: it must map back to its own name)
        if all(i is not None and tokenizer.convert_ids_to_tokens(i) == n for i, n in zip(ids, names)):
            return ids[0], ids[1], ids[2]
    return None


def fim_prompt(tokenizer, prefix: str | list[int], suffix: str, max_tokens: int | None = None) -> list[int]:
    """The token ids of a fill-in-the-middle prompt, `<prefix marker> prefix <suffix marker> suffix
    <middle marker>` (the model then writes the middle); `prefix` as text or token ids. A
    PromptError if the model has no FIM markers (fim_token_ids)."""
    markers = fim_token_ids(tokenizer)
    if markers is None:
        raise NoFIMError("suffix needs a model with fill-in-the-middle tokens (" +
                          " / ".join(", ".join(names) for names in FIM_TOKENS) + "); this model has none")
    pre, suf, mid = markers
    head = list(prefix) if isinstance(prefix, list) else encode_text(tokenizer, prefix, "prompt", False, max_tokens)
    tail = encode_text(tokenizer, suffix, "suffix", False, max_tokens)
    return [pre, *head, suf, *tail, mid]


def prompt_to_ids(tokenizer, prompt: Any) -> tuple[str | None, list[int]]:
    """(text or None, token ids) of an engine prompt: a string, a token-id list, or a dict with
    `prompt_token_ids` (used as given) or `prompt` (tokenized)."""
    if isinstance(prompt, str):
        return prompt, encode_text(tokenizer, prompt)
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"], encode_text(tokenizer, prompt["prompt"])
        raise PromptError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
        return None, list(prompt)
    raise PromptError(f"unsupported prompt type {type(prompt).__name__}")


def _content_text(content: Any, where: str) -> str:
    if content is None:
        return ""  # templates concatenate content: None would break them
    if isinstance(content, str):
        return check_text(content, where)
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            # "input_text"/"output_text": the Responses API's names for the same thing.
            if kind not in ("text", "input_text", "output_text") or not isinstance(part.get("text"), str):
                raise PromptError(f"{where}[{j}]: content part type {kind!r} is not supported (text only)")
            parts.append(check_text(part["text"], f"{where}[{j}].text"))
        return "\n".join(parts)
    raise PromptError(f"{where} must be a string or a list of text parts")


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Checked copies of OpenAI-style messages, ready for a chat template."""
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise PromptError(f"{where} must be an object")
        role = m.get("role")
        if role not in ROLES:
            raise PromptError(f"{where}.role {role!r} is not a chat role; use one of {', '.join(ROLES)}")
        d = {k: v for k, v in m.items() if v is not None}
        d["content"] = _content_text(m.get("content"), f"{where}.content")
        if isinstance(d.get("name"), str):
            check_text(d["name"], f"{where}.name")
        if role == "tool" and not isinstance(m.get("tool_call_id", ""), str):
            raise PromptError(f"{where}.tool_call_id must be a string")
        if m.get("tool_calls"):
            if role != "assistant":
                raise PromptError(f"{where}: only assistant messages carry tool_calls")
            d["tool_calls"] = [_tool_call_for_template(c, f"{where}.tool_calls[{j}]")
                               for j, c in enumerate(m["tool_calls"])]
        out.append(d)
    return out


def _tool_call_for_template(call: Any, where: str) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise PromptError(f"{where} needs function.name")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        check_text(args, f"{where}.function.arguments")
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise PromptError(f"{where}.function.arguments is not valid JSON") from None
    return {**call, "function": {**fn, "arguments": args}}


def render_chat(
    tokenizer,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template: str | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    max_tokens: int | None = None,
) -> list[int]:
    """Token ids of a conversation rendered with the chat template (which adds BOS itself).

    `tools` are OpenAI function tools (`{"type": "function", "function": {...}}`), passed to the
    template as transformers' `tools=`. Raises `PromptError` (a ValueError) naming the problem,
    `PromptTooLongError` past `max_tokens` tokens.
    """
    template = chat_template or tokenizer.chat_template
    if not template:
        raise PromptError("this model has no chat template; pass a chat template or send a plain prompt")
    convo = normalize_messages(messages)
    try:
        text = tokenizer.apply_chat_template(
            convo, tools=tools or None, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, chat_template=template, **(chat_template_kwargs or {}),
        )
    except Exception as e:  # jinja raises for e.g. non-alternating roles
        raise PromptError(f"the chat template could not render these messages: {e}") from None
    return _encode(tokenizer, text, False, max_tokens)


def score_pairs(data_1: str | list[str], data_2: str | list[str]) -> list[tuple[str, str]]:
    """The (query, document) pairs of a score request, as vLLM pairs them: one query against every
    document, or the two lists side by side; a PromptError when they cannot pair."""
    a = [data_1] if isinstance(data_1, str) else list(data_1)
    b = [data_2] if isinstance(data_2, str) else list(data_2)
    if not a or not b:
        raise PromptError("score needs at least one text on each side")
    if len(a) == 1:
        a = a * len(b)
    if len(a) != len(b):
        raise PromptError(f"score pairs {len(a)} texts with {len(b)}: give one, or as many as the other side")
    for i, (x, y) in enumerate(zip(a, b)):
        if not isinstance(x, str) or not isinstance(y, str):
            raise PromptError(f"score pair {i} is not two strings")
    return list(zip(a, b))


def encode_pair(tokenizer, first: str, second: str, max_length: int | None = None, use_sep_token: bool = True,
                score_template: str | None = None) -> list[int]:
    """Token ids of a scoring model's input for a (query, document) pair, as vLLM builds it: with a
    `score_template` (a chat template over the roles "query" and "document", vLLM's
    `--chat-template` for LLM-as-reranker models such as Qwen3-Reranker) the rendered text; else a
    cross-encoder's `[CLS] first [SEP] second [SEP]` (the tokenizer's pair template,
    `use_sep_token`) or an LLM reranker's two texts as one. Cut to `max_length` tokens when given
    (a pair: the longer side first, as sentence-transformers)."""
    check_text(first, "query")
    check_text(second, "document")
    cut = {} if max_length is None else {"truncation": True, "max_length": max_length}
    if score_template is None and use_sep_token:
        return list(tokenizer(first, second, **cut)["input_ids"])
    text = first + second
    if score_template is not None:
        messages = [{"role": "query", "content": first}, {"role": "document", "content": second}]
        try:
            text = tokenizer.apply_chat_template(messages, chat_template=score_template, tokenize=False)
        except Exception as e:  # jinja's errors
            raise PromptError(f"the score template could not render this pair: {e}") from None
    return list(tokenizer(text, **cut)["input_ids"])
