"""/v1/messages (Anthropic's Messages API) with the official `anthropic` client, on the shared SmolLM2
server (hermes tool parser): prompts as transformers' chat template renders them, greedy text as
the chat endpoint's, stop reasons, streaming events, a tool-use round trip checked with jsonschema,
count_tokens, and errors in Anthropic's shape."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

anthropic = pytest.importorskip("anthropic")
pytest.importorskip("xgrammar")

from openai import OpenAI  # noqa: E402
from server_process import API_KEY  # noqa: E402

GREEDY = {"temperature": 0}  # (the newest SDKs left temperature out of create(); the API still takes it)
WEATHER = {"name": "get_weather", "description": "Get the current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                            "required": ["city"], "additionalProperties": False}}
PARIS = [{"role": "user", "content": "What's the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(smollm2_server):
    return anthropic.Anthropic(base_url=smollm2_server.url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def openai_client(smollm2_server):
    return OpenAI(base_url=smollm2_server.base_url, api_key="unused", max_retries=0, timeout=120)


def text_of(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_system_and_multi_turn_match_the_chat_template_and_chat_endpoint(client, openai_client, tokenizer_dir):
    from transformers import AutoTokenizer

    system = "You are a helpful geography teacher."
    turns = [{"role": "user", "content": "Name a big city in France."},
             {"role": "assistant", "content": "Paris is a big city in France."},
             {"role": "user", "content": [{"type": "text", "text": "What river flows through it?"}]}]
    chat = [{"role": "system", "content": system}, turns[0], turns[1],
            {"role": "user", "content": "What river flows through it?"}]
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    expected = tok(tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False),
                   add_special_tokens=False)["input_ids"]
    for sys in (system, [{"type": "text", "text": system}]):
        m = client.messages.create(model="smollm2", max_tokens=24, system=sys, messages=turns, extra_body=GREEDY)
        assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
        assert m.usage.input_tokens == len(expected)
        counted = client.messages.count_tokens(model="smollm2", system=sys, messages=turns)
        assert counted.input_tokens == m.usage.input_tokens
    ref = openai_client.chat.completions.create(model="smollm2", messages=chat, max_tokens=24, temperature=0)
    assert text_of(m) == ref.choices[0].message.content and m.usage.output_tokens == ref.usage.completion_tokens
    assert m.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[ref.choices[0].finish_reason]


def test_stop_reasons(client):
    ask = [{"role": "user", "content": "Say hello."}]
    # (room to end its turn in any dtype: 23 tokens in float32, 64 in bfloat16, the GGUF default)
    whole = client.messages.create(model="smollm2", max_tokens=200, messages=ask, extra_body=GREEDY)
    assert whole.stop_reason == "end_turn" and whole.stop_sequence is None and whole.usage.output_tokens < 200
    text = text_of(whole)
    cut = client.messages.create(model="smollm2", max_tokens=3, messages=ask, extra_body=GREEDY)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3 and text.startswith(text_of(cut))
    word = text.split()[2]
    stopped = client.messages.create(model="smollm2", max_tokens=200, messages=ask, stop_sequences=["zzz", word],
                                      extra_body=GREEDY)
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert text_of(stopped) == text[:text.index(word)]


def test_streaming_matches_the_whole_message(client, smollm2_server):
    kw = dict(model="smollm2", max_tokens=20, messages=[{"role": "user", "content": "Tell me about the sea."}],
              extra_body=GREEDY)
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text_of(whole) == text_of(final)
    assert (final.stop_reason, final.usage.input_tokens, final.usage.output_tokens) == \
        (whole.stop_reason, whole.usage.input_tokens, whole.usage.output_tokens)
    # The raw events, in Anthropic's order.
    body = {"model": "smollm2", "max_tokens": 5, "stream": True, "messages": kw["messages"], **GREEDY}
    kinds = [line.removeprefix("event: ") for line in
             httpx.post(f"{smollm2_server.url}/v1/messages", json=body, timeout=60).text.splitlines()
             if line.startswith("event: ")]
    assert kinds[:3] == ["message_start", "content_block_start", "ping"]
    assert set(kinds[3:-3]) == {"content_block_delta"}
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_tool_use_round_trip(client):
    forced = client.messages.create(model="smollm2", max_tokens=60, messages=PARIS, tools=[WEATHER],
                                    tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    (call,) = forced.content
    assert forced.stop_reason == "tool_use" and call.type == "tool_use" and call.name == "get_weather"
    jsonschema.validate(call.input, WEATHER["input_schema"])
    # "any" streamed: the SDK assembles the same call from input_json_delta events.
    with client.messages.stream(model="smollm2", max_tokens=60, messages=PARIS, tools=[WEATHER],
                                tool_choice={"type": "any"}, extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    (streamed,) = final.content
    assert final.stop_reason == "tool_use" and streamed.name == "get_weather"
    jsonschema.validate(streamed.input, WEATHER["input_schema"])
    # The call and its result go back; the model answers in text.
    history = PARIS + [{"role": "assistant", "content": [call.model_dump(include={"type", "id", "name", "input"})]},
                       {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                     "content": [{"type": "text", "text": "Sunny, 21 C"}]}]}]
    answer = client.messages.create(model="smollm2", max_tokens=20, messages=history, tools=[WEATHER],
                                    tool_choice={"type": "none"}, extra_body=GREEDY)
    assert text_of(answer) and answer.stop_reason in ("end_turn", "max_tokens")
    counted = client.messages.count_tokens(model="smollm2", messages=history, tools=[WEATHER])
    assert counted.input_tokens == answer.usage.input_tokens


def test_structured_output(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    fmt = {"output_config": {"format": {"type": "json_schema", "schema": schema}}}
    m = client.messages.create(model="smollm2", max_tokens=60, messages=[{"role": "user", "content": "A person."}],
                               extra_body={**fmt, **GREEDY})
    jsonschema.validate(json.loads(text_of(m)), schema)


@pytest.mark.parametrize("body,status,kind,message", [
    ({"messages": [{"role": "user", "content": "hi"}]}, 400, "invalid_request_error", "max_tokens: Field required"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0K"}}]}]},
     400, "invalid_request_error", "image content blocks are not supported"),
    ({"max_tokens": 5, "messages": PARIS, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     400, "invalid_request_error", "is a server tool"),
    ({"max_tokens": 5, "messages": PARIS, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}},
     400, "invalid_request_error", "'nope', which is not among the tools"),
    ({"max_tokens": 5000, "messages": PARIS}, 400, "invalid_request_error", "maximum context length is 2048"),
    ({"max_tokens": 5, "messages": PARIS, "model": "claude-nope"}, 404, "not_found_error",
     "'claude-nope' does not exist"),
])
def test_errors_in_anthropic_shape(smollm2_server, body, status, kind, message):
    r = httpx.post(f"{smollm2_server.url}/v1/messages", json={"model": "smollm2", **body}, timeout=60)
    assert r.status_code == status and r.json()["type"] == "error", r.text
    assert r.json()["error"]["type"] == kind and message in r.json()["error"]["message"], r.text


def test_sdk_errors_and_x_api_key(client, auth_server):
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-nope", max_tokens=5, messages=PARIS)
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model="smollm2", max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}])
    # Anthropic's clients send the key as x-api-key.
    keyed = anthropic.Anthropic(base_url=auth_server.url, api_key=API_KEY, max_retries=0, timeout=60)
    assert keyed.messages.count_tokens(model="tiny", messages=PARIS).input_tokens > 0
    wrong = anthropic.Anthropic(base_url=auth_server.url, api_key="wrong", max_retries=0, timeout=60)
    with pytest.raises(anthropic.AuthenticationError) as e:
        wrong.messages.count_tokens(model="tiny", messages=PARIS)
    assert e.value.body["error"]["type"] == "authentication_error"
