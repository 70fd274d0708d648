"""Structured outputs and tool calling through the server, with the official `openai` client and
LangChain's ChatOpenAI, on SmolLM2 (hermes parser) and, for the real tool-calling checks, on
Qwen2.5-Coder-0.5B-Instruct."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest
from openai import OpenAI

from structured_schemas import SCHEMAS
from test_server import ServerProcess

pytest.importorskip("xgrammar")

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                       "required": ["city"], "additionalProperties": False},
    },
}
ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers",
        "parameters": {"type": "object",
                       "properties": {"a": {"type": "integer", "minimum": -999, "maximum": 999},
                                      "b": {"type": "integer", "minimum": -999, "maximum": 999}},
                       "required": ["a", "b"], "additionalProperties": False},
    },
}
PARIS = [{"role": "user", "content": "What's the weather in Paris?"}]


@pytest.fixture(scope="module")
def smol(smollm2_server):
    """SmolLM2 with the hermes parser (conftest.py: shared with test_server's SmolLM2 test)."""
    return smollm2_server


@pytest.fixture(scope="module")
def client(smol) -> OpenAI:
    return OpenAI(base_url=smol.base_url, api_key="unused", max_retries=0, timeout=120)


def model_of(client: OpenAI) -> str:
    return client.models.list().data[0].id


# ---- structured outputs ---------------------------------------------------------------------------


def test_response_format_json_schema_and_json_object(client):
    m = model_of(client)
    for question, schema in [SCHEMAS[0], SCHEMAS[12], SCHEMAS[16]]:
        r = client.chat.completions.create(
            model=m, messages=[{"role": "user", "content": question}], temperature=0, max_tokens=120,
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}})
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    r = client.chat.completions.create(model=m, messages=[{"role": "user", "content": "A JSON object about a dog."}],
                                       temperature=0, max_tokens=60, response_format={"type": "json_object"},
                                       stop=["\n"])  # any-JSON is unbounded: keep it short
    assert r.choices[0].message.content.startswith("{")


def test_vllm_fields_on_chat_and_completions(client):
    m = model_of(client)
    q = [{"role": "user", "content": "Give a phone number."}]
    r = client.chat.completions.create(model=m, messages=q, temperature=0, max_tokens=20,
                                       extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}})
    assert re.fullmatch(r"\d{3}-\d{4}", r.choices[0].message.content)
    r = client.chat.completions.create(model=m, messages=q, temperature=0, max_tokens=20,
                                       extra_body={"guided_choice": ["alpha", "beta"]})
    assert r.choices[0].message.content in ("alpha", "beta")
    r = client.chat.completions.create(model=m, messages=q, temperature=0, max_tokens=20,
                                       extra_body={"guided_grammar": 'root ::= "tel:" [0-9] [0-9] [0-9]'})
    assert re.fullmatch(r"tel:\d{3}", r.choices[0].message.content)
    schema = SCHEMAS[3][1]
    r = client.completions.create(model=m, prompt="A point as JSON: ", temperature=0, max_tokens=40,
                                  extra_body={"guided_json": schema})
    jsonschema.validate(json.loads(r.choices[0].text), schema)
    r = client.completions.create(model=m, prompt="The answer is ", temperature=0, max_tokens=10, n=2,
                                  extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert all(c.text in ("yes", "no") for c in r.choices)
    r = client.completions.create(model=m, prompt="A point as JSON: ", temperature=0, max_tokens=40,
                                  extra_body={"response_format": {"type": "json_schema",
                                                                  "json_schema": {"name": "p", "schema": schema}}})
    jsonschema.validate(json.loads(r.choices[0].text), schema)


def test_streamed_structured_equals_non_streamed(client):
    m = model_of(client)
    kw = dict(model=m, messages=[{"role": "user", "content": "A team of people."}], temperature=0, max_tokens=120,
              response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMAS[12][1]}})
    full = client.chat.completions.create(**kw).choices[0].message.content
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                   if c.choices)
    assert text == full
    jsonschema.validate(json.loads(text), SCHEMAS[12][1])


# ---- tool calling ---------------------------------------------------------------------------------


def test_tool_choice_required_and_named(client):
    m = model_of(client)
    r = client.chat.completions.create(model=m, messages=PARIS, tools=[WEATHER_TOOL, ADD_TOOL],
                                       tool_choice="required", temperature=0, max_tokens=100)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        tool = {"get_weather": WEATHER_TOOL, "add": ADD_TOOL}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    r = client.chat.completions.create(model=m, messages=PARIS, tools=[WEATHER_TOOL, ADD_TOOL], temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "add"}},
                                       parallel_tool_calls=False, max_tokens=40)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "add" and set(json.loads(call.function.arguments)) == {"a", "b"}
    assert r.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_tool_call_reassembles_to_the_non_streamed_one(client, tool_choice):
    kw = dict(model=model_of(client), messages=PARIS, tools=[WEATHER_TOOL], tool_choice=tool_choice,
              temperature=0, max_tokens=60)
    full = client.chat.completions.create(**kw).choices[0].message.tool_calls
    chunks = [c for c in client.chat.completions.create(stream=True, **kw) if c.choices]
    calls: dict[int, dict] = {}
    for c in chunks:
        for d in c.choices[0].delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": d.id, "name": None, "arguments": ""})
            if d.function.name:
                assert call["name"] is None and call["arguments"] == ""  # the name comes first, once
                call["name"] = d.function.name
            call["arguments"] += d.function.arguments or ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in full]
    assert all(c["id"].startswith("call_") for c in calls.values())
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_auto_tool_choice_parses_hermes_text_and_history_renders(client):
    m = model_of(client)
    # SmolLM2 rarely calls tools on its own: whatever it says, the answer is well-formed.
    r = client.chat.completions.create(model=m, messages=PARIS, tools=[WEATHER_TOOL], temperature=0, max_tokens=30)
    msg = r.choices[0].message
    assert (msg.tool_calls and r.choices[0].finish_reason == "tool_calls") or (msg.content and not msg.tool_calls)
    # A conversation that already called the tool (arguments as JSON text, as clients send them).
    history = PARIS + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature_c": 21, "sky": "sunny"}'},
    ]
    r = client.chat.completions.create(model=m, messages=history, tools=[WEATHER_TOOL], tool_choice="none",
                                       temperature=0, max_tokens=20)
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls


# ---- bad input: 400s naming the problem, and the server keeps serving -----------------------------


def post(smol, path: str, body: dict | bytes) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(f"{smol.url}{path}", content=body, headers={"Content-Type": "application/json"}, timeout=60)
    return httpx.post(f"{smol.url}{path}", json=body, timeout=60)


BAD = [
    ("/v1/chat/completions", {"messages": PARIS, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}}, "invalid JSON schema"),
    ("/v1/chat/completions", {"messages": PARIS, "guided_regex": "a(b"}, "invalid regex"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "[z-a]"}}, "invalid regex"),
    ("/v1/chat/completions", {"messages": PARIS, "guided_grammar": "root ::= missing"}, "invalid grammar"),
    ("/v1/chat/completions", {"messages": PARIS, "guided_json": "{not json"}, "not valid JSON"),
    ("/v1/chat/completions", {"messages": PARIS, "guided_regex": "a", "guided_choice": ["a"]}, "one output constraint"),
    ("/v1/chat/completions", {"messages": PARIS, "response_format": {"type": "xml"}}, "'xml' is not supported"),
    ("/v1/chat/completions", {"messages": PARIS, "tools": [WEATHER_TOOL],
                              "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "'get_time', which is not among the tools"),
    ("/v1/chat/completions", {"messages": PARIS, "tool_choice": "required"}, "needs tools"),
    ("/v1/chat/completions", {"messages": PARIS, "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "no tools were given"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "'wizard' is not a chat role"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "bad \\ud800 text"}]}',
     "messages[0].content is not valid Unicode"),
    ("/v1/completions", b'{"prompt": "bad \\udfff", "max_tokens": 2}', "prompt is not valid Unicode"),
    ("/tokenize", b'{"prompt": "\\ud800"}', "prompt is not valid Unicode"),
    # token ids a tokenizer's decode cannot even take (echo decodes the prompt): checked first
    ("/v1/completions", {"prompt": [-5, 3], "max_tokens": 2}, "prompt token id -5 is out of range"),
    ("/v1/completions", {"prompt": [1, 2, 2**40], "max_tokens": 2, "echo": True}, f"prompt token id {2**40} is out of range"),
]


@pytest.mark.parametrize("path,body,message", BAD, ids=[b[2] for b in BAD])
def test_bad_input_is_a_400_naming_it(smol, path, body, message):
    r = post(smol, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert message in err["message"] and err["type"] == "invalid_request_error"
    ok = post(smol, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200


# ---- LangChain ------------------------------------------------------------------------------------


def test_langchain_bind_tools_and_with_structured_output(smol):
    lc = pytest.importorskip("langchain_openai")
    from pydantic import BaseModel, Field

    llm = lc.ChatOpenAI(base_url=smol.base_url, api_key="unused", model=model_of(
        OpenAI(base_url=smol.base_url, api_key="unused")), temperature=0, max_tokens=80, max_retries=0)

    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return "sunny"

    msg = llm.bind_tools([get_weather], tool_choice="required").invoke("What's the weather in Paris?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather"
    assert isinstance(msg.tool_calls[0]["args"].get("city"), str)

    class Person(BaseModel):
        """A person."""

        name: str = Field(max_length=16)
        age: int = Field(ge=0, le=120)

    for method in ("json_schema", "function_calling"):
        p = llm.with_structured_output(Person, method=method).invoke("Describe a person called Ada, aged 36.")
        assert isinstance(p, Person) and 0 <= p.age <= 120


# ---- /v1/responses ---------------------------------------------------------------------------------


FLAT_WEATHER = {"type": "function", **WEATHER_TOOL["function"]}


def test_responses_text_format_tools_and_items(client):
    m = model_of(client)
    r = client.responses.create(model=m, input="Say hello.", instructions="Answer in one short sentence.",
                                max_output_tokens=8, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.output_text
    assert r.status in ("completed", "incomplete") and r.usage.output_tokens <= 8
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
    schema = SCHEMAS[0][1]
    r = client.responses.create(model=m, input=[{"role": "user", "content": [{"type": "input_text",
                                                                                "text": "Describe a person."}]}],
                                text={"format": {"type": "json_schema", "name": "person", "schema": schema,
                                                 "strict": True}},
                                max_output_tokens=80, temperature=0)
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
    r = client.responses.create(model=m, input="What's the weather in Paris?", tools=[FLAT_WEATHER],
                                tool_choice="required", max_output_tokens=60, temperature=0)
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER_TOOL["function"]["parameters"])
    # The call and its output go back as input items; the model answers in text.
    follow = client.responses.create(
        model=m, tools=[FLAT_WEATHER], tool_choice="none", max_output_tokens=20, temperature=0,
        input=[{"role": "user", "content": "What's the weather in Paris?"},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "sunny"}'}])
    assert follow.output_text and not [o for o in follow.output if o.type == "function_call"]


def test_responses_streaming_events(client):
    m = model_of(client)
    kw = dict(model=m, input="Tell me about the sea.", max_output_tokens=16, temperature=0)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text and events[-1].response.output_text == text
    # A forced function call streams as a function_call item.
    events = list(client.responses.create(model=m, input="What's the weather in Paris?", tools=[FLAT_WEATHER],
                                          tool_choice={"type": "function", "name": "get_weather"},
                                          max_output_tokens=40, temperature=0, stream=True))
    added = [e.item for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert [a.name for a in added] == ["get_weather"] and "city" in json.loads(args)
    assert events[-1].type == "response.completed"


@pytest.mark.parametrize("body,message", [
    ({"input": "x", "tools": [{"type": "web_search"}]}, "function tools only"),
    ({"input": [{"role": "wizard", "content": "x"}]}, "'wizard' is not a chat role"),
    ({"input": "x", "tools": [FLAT_WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
     "'nope', which is not among the tools"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
     "invalid JSON schema"),
])
def test_responses_bad_input(smol, body, message):
    r = post(smol, "/v1/responses", body)
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text


# ---- Qwen2.5-Coder-0.5B-Instruct: a real tool-calling model (hermes template) ----------------------


@pytest.fixture(scope="module")
def qwen(qwen_coder_gguf, tmp_path_factory):
    srv = ServerProcess(qwen_coder_gguf, ["--kv-cache-space", "0.2", "--max-model-len", "2048",
                                          "--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
                        str(tmp_path_factory.mktemp("qwen") / "server.log"), startup_timeout=400)
    yield srv
    srv.stop()


def test_qwen_weather_tool_call_streamed_and_follow_up(qwen):
    client = OpenAI(base_url=qwen.base_url, api_key="unused", max_retries=0, timeout=300)
    kw = dict(model=model_of(client), messages=PARIS, tools=[WEATHER_TOOL], temperature=0, max_tokens=40)
    r = client.chat.completions.create(tool_choice="required", **kw)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert "paris" in json.loads(call.function.arguments)["city"].lower()
    # Streamed: the deltas put together are the same call.
    name, args = None, ""
    for c in client.chat.completions.create(tool_choice="required", stream=True, **kw):
        for d in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            name = name or d.function.name
            args += d.function.arguments or ""
    assert (name, json.loads(args)) == (call.function.name, json.loads(call.function.arguments))
    # "auto": the model decides to call the tool itself (hermes <tool_call> text, parsed).
    auto = client.chat.completions.create(**kw)
    assert [c.function.name for c in auto.choices[0].message.tool_calls or []] == ["get_weather"]
    assert auto.choices[0].finish_reason == "tool_calls"
    # The tool's result goes back; the model answers in text.
    history = PARIS + [r.choices[0].message.model_dump(exclude_none=True),
                       {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 21, "sky": "sunny"}'}]
    follow = client.chat.completions.create(**dict(kw, messages=history, max_tokens=40))
    text = follow.choices[0].message.content
    assert not follow.choices[0].message.tool_calls and text and re.search(r"21|sunny", text), text


def test_qwen_json_schemas(qwen):
    client = OpenAI(base_url=qwen.base_url, api_key="unused", max_retries=0, timeout=300)
    for question, schema in [SCHEMAS[0], SCHEMAS[4], SCHEMAS[13]]:
        r = client.chat.completions.create(
            model=model_of(client), messages=[{"role": "user", "content": question}], temperature=0, max_tokens=80,
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
