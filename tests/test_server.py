"""The OpenAI-compatible server, end to end: a real `armserve serve` subprocess on a free
loopback port, driven with the official `openai` client (sync and async) and raw HTTP."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time

import httpx
import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from server_process import API_KEY, ServerProcess, free_port  # noqa: F401 (other test files import it from here)

# ---- fixtures (`server` and `auth_server`: conftest.py, one of each for the session) -----------

MAX_MODEL_LEN = 512  # the tiny checkpoint's max_position_embeddings
HELLO = [{"role": "user", "content": "Hello! Tell me a story."}]


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(server, client) -> str:
    return client.models.list().data[0].id


def aclient(server) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def tokenize_chat(server, messages) -> list[int]:
    r = httpx.post(f"{server.url}/tokenize", json={"messages": messages}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


# ---- basic endpoints ---------------------------------------------------------------------------


def test_health_version_models(server, client, tiny_llama):
    assert httpx.get(f"{server.url}/health").status_code == 200
    import armserve

    assert httpx.get(f"{server.url}/version").json() == {"version": armserve.__version__}
    models = client.models.list().data
    assert [m.id for m in models] == [tiny_llama]
    assert models[0].max_model_len == MAX_MODEL_LEN  # vLLM's extra field
    assert client.models.retrieve(tiny_llama).id == tiny_llama
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_tokenize_detokenize(server):
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert r["count"] == len(r["tokens"]) == 2 and r["max_model_len"] == MAX_MODEL_LEN
    assert r["token_strs"] == ["Hello", "Ġworld"]
    back = httpx.post(f"{server.url}/detokenize", json={"tokens": r["tokens"]}).json()
    assert back == {"prompt": "Hello world"}
    bad = httpx.post(f"{server.url}/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and "out of range" in bad.json()["error"]["message"]
    both = httpx.post(f"{server.url}/tokenize", json={"prompt": "a", "messages": HELLO})
    assert both.status_code == 400 and "exactly one" in both.json()["error"]["message"]


# ---- chat --------------------------------------------------------------------------------------


def test_chat_non_streaming_usage_is_exact(server, client, model):
    r = client.chat.completions.create(model=model, messages=HELLO, max_tokens=12, extra_body={"ignore_eos": True})
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == model
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert r.usage.prompt_tokens == len(tokenize_chat(server, HELLO))
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_chat_max_completion_tokens_wins(client, model):
    r = client.chat.completions.create(model=model, messages=HELLO, max_tokens=20, max_completion_tokens=5,
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"


def test_chat_streamed_equals_non_streamed_same_seed(client, model):
    kw = dict(model=model, messages=HELLO, max_tokens=24, temperature=1.0, seed=1234, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    # include_usage: every chunk has usage null except the last, which has no choices.
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    # Same seed, same answer; another seed, another answer.
    assert client.chat.completions.create(**kw).choices[0].message.content == text
    other = client.chat.completions.create(**dict(kw, seed=99)).choices[0].message.content
    assert other != text


def test_chat_n2(client, model):
    kw = dict(model=model, messages=HELLO, max_tokens=10, n=2, temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**kw)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.choices[0].message.content != r.choices[1].message.content
    assert r.usage.completion_tokens == 20
    texts = ["", ""]
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == [c.message.content for c in sorted(r.choices, key=lambda c: c.index)]


def test_chat_stop_string(client, model):
    base = client.chat.completions.create(model=model, messages=HELLO, max_tokens=24, temperature=0,
                                          extra_body={"ignore_eos": True}).choices[0].message.content
    stop = base[len(base) // 2: len(base) // 2 + 3]
    assert stop.strip(), base
    expected = base[: base.index(stop)]
    r = client.chat.completions.create(model=model, messages=HELLO, max_tokens=24, temperature=0, stop=[stop],
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == expected
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == stop
    streamed = client.chat.completions.create(model=model, messages=HELLO, max_tokens=24, temperature=0,
                                              stop=stop, stream=True, extra_body={"ignore_eos": True})
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_chat_logprobs(client, model):
    r = client.chat.completions.create(model=model, messages=HELLO, max_tokens=8, temperature=0, logprobs=True,
                                       top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 8
    for entry in content:
        assert len(entry.top_logprobs) == 3
        lps = [t.logprob for t in entry.top_logprobs]
        assert lps == sorted(lps, reverse=True) and all(lp <= 0 for lp in lps)
        # Greedy: the chosen token is the most likely one.
        assert entry.token == entry.top_logprobs[0].token
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
    # logprobs without top_logprobs: the chosen token only.
    r = client.chat.completions.create(model=model, messages=HELLO, max_tokens=4, logprobs=True)
    assert all(e.top_logprobs == [] for e in r.choices[0].logprobs.content)
    assert client.chat.completions.create(model=model, messages=HELLO, max_tokens=2).choices[0].logprobs is None


def test_chat_without_max_tokens_fills_the_context(server, client, model):
    # A long conversation leaves little room, so generating "to the end" stays cheap.
    messages = [{"role": "user", "content": "word " * 400}]
    n_prompt = len(tokenize_chat(server, messages))
    r = client.chat.completions.create(model=model, messages=messages, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == MAX_MODEL_LEN - n_prompt


# ---- completions -------------------------------------------------------------------------------


def test_completion_streamed_equals_non_streamed(client, model):
    kw = dict(model=model, prompt="Once upon a time", max_tokens=16, temperature=0.8, seed=5,
              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    assert full.object == "text_completion" and full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 16
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_completion_echo_n_and_batch(server, client, model):
    prompt = "The quick brown fox"
    r = client.completions.create(model=model, prompt=prompt, max_tokens=4, echo=True, temperature=0)
    assert r.choices[0].text.startswith(prompt) and len(r.choices[0].text) > len(prompt)
    # Token-id prompts and batches: choice index = prompt index * n + i.
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": prompt}).json()["tokens"]
    r = client.completions.create(model=model, prompt=[prompt, "Hello"], n=2, max_tokens=3, temperature=1.0,
                                  seed=3, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage.completion_tokens == 12
    r_ids = client.completions.create(model=model, prompt=ids, n=2, max_tokens=3, temperature=1.0, seed=3,
                                      extra_body={"ignore_eos": True})
    by_index = {c.index: c.text for c in r.choices}
    assert [c.text for c in sorted(r_ids.choices, key=lambda c: c.index)] == [by_index[0], by_index[1]]
    texts = {}
    for chunk in client.completions.create(model=model, prompt=[prompt, "Hello"], n=2, max_tokens=3, temperature=1.0,
                                           seed=3, stream=True, extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == by_index


def test_completion_logprobs_and_echo(client, model):
    r = client.completions.create(model=model, prompt="Hello world", max_tokens=5, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    assert all(len(top) == 2 for top in lp.top_logprobs)
    assert all(a <= b for a, b in zip(lp.text_offset, lp.text_offset[1:]))
    r = client.completions.create(model=model, prompt="Hello world", max_tokens=3, temperature=0, logprobs=1,
                                  echo=True, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert lp.tokens[:2] == ["Hello", " world"] and lp.token_logprobs[0] is None
    assert lp.token_logprobs[1] < 0 and len(lp.tokens) == 2 + 3
    assert r.choices[0].text.startswith("Hello world")


# ---- errors ------------------------------------------------------------------------------------


def _bad_requests(model: str) -> list[tuple[str, dict, str]]:
    """(endpoint, body, words the error message must contain)."""
    chat = {"model": model, "messages": HELLO}
    comp = {"model": model, "prompt": "Hi"}
    return [
        ("chat/completions", dict(chat, temperature=-1), "temperature"),
        ("chat/completions", dict(chat, temperature="hot"), "temperature"),
        ("chat/completions", dict(chat, top_p=0), "top_p"),
        ("chat/completions", dict(chat, n=0), "n"),
        ("chat/completions", dict(chat, top_logprobs=50, logprobs=True), "top_logprobs"),
        ("chat/completions", dict(chat, top_logprobs=2), "top_logprobs"),
        ("chat/completions", dict(chat, max_tokens=0), "max_tokens"),
        ("chat/completions", dict(chat, max_tokens=10_000), "max_tokens"),
        ("chat/completions", dict(chat, stop=[""]), "stop"),
        ("chat/completions", dict(chat, stream_options={"include_usage": True}), "stream_options"),
        ("chat/completions", dict(chat, messages=[]), "messages"),
        ("chat/completions", dict(chat, messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
         "image_url"),
        ("chat/completions", {"model": model}, "messages"),
        ("chat/completions", dict(chat, messages=[{"role": "user", "content": "x " * 600}]),
         "maximum context length"),
        ("chat/completions", dict(chat, logit_bias={"1": 5}), "logit_bias"),
        ("completions", dict(comp, prompt=[10**9]), "out of range"),
        ("completions", dict(comp, prompt=list(range(MAX_MODEL_LEN))), "maximum context length"),
        ("completions", dict(comp, logprobs=-1), "logprobs"),
        ("completions", dict(comp, presence_penalty=5), "presence_penalty"),
        ("completions", dict(comp, seed="abc"), "seed"),
        ("completions", dict(comp, prompt=[]), "prompt"),
    ]


def test_invalid_requests_get_400_naming_the_problem(server, client, model):
    for endpoint, body, words in _bad_requests(model):
        r = httpx.post(f"{server.base_url}/{endpoint}", json=body, timeout=30)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert words in err["message"], (body, err)
        assert err["type"] == "invalid_request_error"
    # Through the official client the same errors are BadRequestError.
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=model, messages=HELLO, temperature=-0.5)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="x " * 600)
    assert e.value.code == "context_length_exceeded"


def test_malformed_json_and_unknown_routes(server):
    r = httpx.post(f"{server.base_url}/chat/completions", content=b'{"model": "x", "messages": [',
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(f"{server.base_url}/chat/completions", content=b"[1, 2]", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    r = httpx.get(f"{server.base_url}/nope")
    assert r.status_code == 404 and r.json()["error"]["message"]
    r = httpx.get(f"{server.base_url}/chat/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4o", messages=HELLO)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4o", prompt="hi")


def test_bad_requests_do_not_disturb_requests_in_flight(server, model):
    kw = dict(model=model, messages=HELLO, max_tokens=150, temperature=1.0, seed=42, extra_body={"ignore_eos": True})

    async def main():
        client = aclient(server)
        alone = (await client.chat.completions.create(**kw)).choices[0].message.content

        async def streamed() -> str:
            text = ""
            async for chunk in await client.chat.completions.create(stream=True, **kw):
                text += chunk.choices[0].delta.content or "" if chunk.choices else ""
            return text

        async def bad(endpoint, body):
            async with httpx.AsyncClient(timeout=60) as h:
                return (await h.post(f"{server.base_url}/{endpoint}", json=body)).status_code

        task = asyncio.create_task(streamed())
        statuses = await asyncio.gather(*[bad(e, b) for e, b, _ in _bad_requests(model)])
        text = await task
        await client.close()
        return alone, text, statuses

    alone, text, statuses = asyncio.run(main())
    assert set(statuses) == {400}
    assert text == alone


# ---- auth, served names, reasoning -------------------------------------------------------------


def test_api_key(auth_server):
    no_key = OpenAI(base_url=auth_server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        no_key.models.list()
    with pytest.raises(openai.AuthenticationError):
        no_key.chat.completions.create(model="tiny", messages=HELLO, max_tokens=2)
    r = httpx.post(f"{auth_server.base_url}/completions", json={"model": "tiny", "prompt": "hi"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.post(f"{auth_server.url}/tokenize", json={"prompt": "hi"}).status_code == 401
    # vLLM's pooling and scoring routes outside /v1/ need the key as well.
    for path in ("/pooling", "/score", "/rerank", "/v2/rerank"):
        assert httpx.post(f"{auth_server.url}{path}", json={"input": "hi"}).status_code == 401, path
    # Probes and scraping need no key.
    assert httpx.get(f"{auth_server.url}/health").status_code == 200
    assert httpx.get(f"{auth_server.url}/metrics").status_code == 200
    ok = OpenAI(base_url=auth_server.base_url, api_key=API_KEY, max_retries=0)
    assert [m.id for m in ok.models.list().data] == ["tiny", "tiny-alias"]
    r = ok.chat.completions.create(model="tiny-alias", messages=HELLO, max_tokens=3)
    assert r.model == "tiny-alias" and r.usage.completion_tokens >= 1
    with pytest.raises(openai.NotFoundError):
        ok.chat.completions.create(model="tiny-llama", messages=HELLO, max_tokens=3)


def test_reasoning_parser(client, model, auth_server):
    # The tiny model never writes </think>: under deepseek_r1 rules, everything it writes is reasoning.
    kw = dict(messages=HELLO, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    plain = client.chat.completions.create(model=model, **kw).choices[0].message
    assert plain.model_extra.get("reasoning_content") is None
    r1 = OpenAI(base_url=auth_server.base_url, api_key=API_KEY, max_retries=0)
    msg = r1.chat.completions.create(model="tiny", **kw).choices[0].message
    assert msg.content is None
    assert msg.model_extra["reasoning_content"] == plain.content
    reasoning = content = ""
    for chunk in r1.chat.completions.create(model="tiny", stream=True, **kw):
        delta = chunk.choices[0].delta
        reasoning += delta.model_extra.get("reasoning_content") or ""
        content += delta.content or ""
    assert reasoning == plain.content and content == ""


# ---- concurrency -------------------------------------------------------------------------------


def _running(metrics: str) -> float:
    """vllm:num_requests_running summed over the engines, from a /metrics page."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("vllm:num_requests_running{"))


def test_eight_concurrent_chats_share_one_batch(server, model):
    """Eight chats streamed at once run in one batch: while they stream, the engine's running-
    requests gauge (polled every ~10 ms) reaches 8, and the stats line says `Running: 8 reqs` when
    a round's overlap spans several of its lines (every 0.2 s here: a window of 0.6 s holds at
    least two). The client cannot force the eight to overlap (on a loaded machine the first one can
    finish before the last one arrives), and a fast machine streams the tiny model's 460 tokens in
    well under a second, so up to three rounds are run."""

    async def one(client: AsyncOpenAI, i: int) -> tuple[float, float, int, str]:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"Question number {i}?"}],
            max_tokens=460, stream=True, extra_body={"ignore_eos": True}, stream_options={"include_usage": True})
        first = last = 0.0
        tokens, reason = 0, ""
        async for chunk in stream:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            if chunk.choices and chunk.choices[0].delta.content:
                last = time.monotonic()
                first = first or last
            if chunk.choices and chunk.choices[0].finish_reason:
                reason = chunk.choices[0].finish_reason
        return first, last, tokens, reason

    async def round_() -> tuple[list[tuple[float, float, int, str]], float]:
        client = aclient(server)
        done = asyncio.Event()
        seen = [0.0]

        async def poll() -> None:
            async with httpx.AsyncClient(timeout=30) as http:
                while not done.is_set():
                    seen.append(_running((await http.get(f"{server.url}/metrics")).text))
                    await asyncio.sleep(0.01)

        poller = asyncio.ensure_future(poll())
        out = await asyncio.gather(*[one(client, i) for i in range(8)])
        done.set()
        await poller
        await client.close()
        return out, max(seen)

    most = window = 0.0
    for _ in range(3):
        log_start = len(server.log())
        results, most = asyncio.run(round_())
        assert all(tokens == 460 and reason == "length" for _, _, tokens, reason in results), results
        window = min(last for _, last, _, _ in results) - max(first for first, _, _, _ in results)
        if most == 8 and window >= 0.6:
            break
    assert most == 8, f"the running-requests gauge reached {most:g}, not 8"
    time.sleep(0.5)  # let the stats logger write its next line
    lines = re.findall(r"Running: (\d+) reqs, Waiting: (\d+) reqs", server.log()[log_start:])
    assert lines, server.log()[log_start:]
    assert max(int(r) for r, _ in lines) <= 8
    if window >= 0.6:
        assert max(int(r) for r, _ in lines) == 8, (window, lines)


def _64_streams_a_quarter_disconnecting(server, model) -> tuple[dict[str, float], dict[str, float]]:
    """64 concurrent chat streams, every fourth dropped after 3 chunks; the metrics before and
    after the engine(s) drained, per engine."""
    before = server.metrics(per_engine=True)

    async def main():
        client = aclient(server)

        async def one(i: int):
            disconnect = i % 4 == 0
            stream = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": f"Load test {i}"}], stream=True,
                max_tokens=400 if disconnect else 24, extra_body={"ignore_eos": True})
            n = 0
            finish = None
            async for chunk in stream:
                n += 1
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
                if disconnect and n == 3:
                    await stream.close()  # drop the connection mid-stream
                    return "disconnected"
            return finish

        out = await asyncio.gather(*[one(i) for i in range(64)])
        await client.close()
        return out

    results = asyncio.run(main())
    assert results.count("disconnected") == 16 and results.count("length") == 48

    for _ in range(100):  # bounded wait for the engine to drain
        m = server.metrics()
        if m["armserve:num_requests_running"] == 0 and m["armserve:num_requests_waiting"] == 0:
            break
        time.sleep(0.1)
    return before, server.metrics(per_engine=True)


def _summed(per_engine: dict[str, float]) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, v in per_engine.items():
        k = re.sub(r',?engine="\d+"', "", key).replace("{,", "{").replace("{}", "")
        out[k] = out.get(k, 0.0) + v
    return out


def test_64_streams_with_a_quarter_disconnecting(server, model):
    before, m = _64_streams_a_quarter_disconnecting(server, model)
    before, m = _summed(before), _summed(m)

    def delta(key: str) -> float:
        return m[key] - before.get(key, 0.0)

    assert m["armserve:num_requests_running"] == 0 and m["armserve:num_requests_waiting"] == 0
    assert m["armserve:kv_cache_used_blocks"] == 0 and m["armserve:kv_cache_usage_perc"] == 0
    assert delta('armserve:request_success_total{finished_reason="length"}') == 48
    assert delta('armserve:request_success_total{finished_reason="abort"}') == 16
    assert delta('armserve:request_success_total{finished_reason="stop"}') == 0
    assert delta('armserve:http_requests_total{handler="/v1/chat/completions",method="POST",status="200"}') == 64
    assert delta("armserve:generation_tokens_total") >= 48 * 24
    assert delta("armserve:time_to_first_token_seconds_count") == 64
    assert delta("armserve:e2e_request_latency_seconds_count") == 64
    # vLLM's names for the same series (dashboards and autoscalers built for vLLM)
    assert delta('vllm:request_success_total{finished_reason="length"}') == 48
    assert delta('vllm:request_success_total{finished_reason="abort"}') == 16
    assert delta("vllm:time_to_first_token_seconds_count") == 64
    assert m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert server.log().count("(client disconnected)") >= 16


def test_non_streaming_disconnect_aborts(server, model):
    before = server.metrics()
    # 480 tokens take ~0.7 s here with step graphs (1.1 s eager): the client gives up long before
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/completions", timeout=httpx.Timeout(0.1, connect=5.0),
                   json={"model": model, "prompt": "Hi", "max_tokens": 480, "ignore_eos": True})
    for _ in range(100):
        m = server.metrics()
        if m['armserve:request_success_total{finished_reason="abort"}'] > \
                before['armserve:request_success_total{finished_reason="abort"}']:
            break
        time.sleep(0.1)
    assert m['armserve:request_success_total{finished_reason="abort"}'] == \
        before['armserve:request_success_total{finished_reason="abort"}'] + 1
    assert m["armserve:kv_cache_used_blocks"] == 0 and m["armserve:num_requests_running"] == 0


def test_metrics_exposes_the_documented_series(server):
    m = server.metrics()
    for name in ["armserve:num_requests_running", "armserve:num_requests_waiting", "armserve:kv_cache_usage_perc",
                 "armserve:prefix_cache_hit_rate", "armserve:prompt_tokens_total", "armserve:generation_tokens_total",
                 "armserve:time_to_first_token_seconds_count", "armserve:time_per_output_token_seconds_count",
                 "armserve:e2e_request_latency_seconds_count", "armserve:prefix_cache_queries_total"]:
        assert name in m, name
    for name in ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total",
                 "generation_tokens_total", "prefix_cache_queries_total", "prefix_cache_hits_total",
                 "num_preemptions_total", "time_to_first_token_seconds_count", "time_per_output_token_seconds_count",
                 "e2e_request_latency_seconds_count", "request_queue_time_seconds_count",
                 "request_prompt_tokens_count", "request_generation_tokens_count"]:
        assert m[f"vllm:{name}"] == m[f"armserve:{name}"], name  # vLLM's names, the same values
    # The same system prompt in every chat: the prefix cache must have hit.
    assert m["armserve:prefix_cache_hits_total"] > 0 and 0 < m["armserve:prefix_cache_hit_rate"] <= 1
    assert re.search(r'armserve\.access: 127\.0\.0\.1:\d+ "POST /v1/chat/completions HTTP/1\.1" 200', server.log())
    assert "Avg prompt throughput:" in server.log() and "Prefix cache hit rate:" in server.log()


# ---- the terminal client -----------------------------------------------------------------------


def test_chat_cli(server):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "armserve.cli", "chat", "--url", server.base_url, "--max-tokens", "6"]
    r = subprocess.run(cmd + ["-q", "Hello"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    # Piped conversation: two turns, then /exit.
    r = subprocess.run(cmd, input="Hi\nAnd again\n/exit\n", capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert len([line for line in r.stdout.splitlines() if line.strip()]) >= 2
    # A server that is not there: a clear error, exit code 1.
    r = subprocess.run([sys.executable, "-m", "armserve.cli", "chat", "--url", f"http://127.0.0.1:{free_port()}/v1",
                        "-q", "hi"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 1 and "cannot reach" in r.stderr


# ---- the real model ----------------------------------------------------------------------------


def test_smollm2_answers_sensibly(smollm2_server):
    client = OpenAI(base_url=smollm2_server.base_url, api_key="unused", max_retries=0, timeout=300)
    # A completion with a wide margin: greedy chat answers of a 135M int4 model flip easily.
    c = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=4,
                                  temperature=0)
    assert c.choices[0].text.startswith(" Paris"), c.choices[0].text
    r = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Which city is the capital of France?"}],
        max_tokens=32, temperature=0)
    answer = r.choices[0].message.content
    assert answer.strip(), answer
    assert r.choices[0].finish_reason in ("stop", "length")
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Which city is the capital of France?"}],
        max_tokens=32, temperature=0, stream=True) if c.choices)
    assert streamed == answer


def test_tools_with_auto_choice_need_the_server_flag(server):
    """As vLLM: tools with tool_choice "auto" (the default) on a server started without
    --enable-auto-tool-choice are a 400; "none" still works."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    body = {"messages": HELLO, "tools": [tool], "max_tokens": 2}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and "--enable-auto-tool-choice" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v1/chat/completions", json=dict(body, tool_choice="none"), timeout=60)
    assert r.status_code == 200 and not r.json()["choices"][0]["message"]["tool_calls"]


def test_data_parallel_engines_map_one_weight_file(dp_server):
    """With data parallelism the engines share their weights (share_weights defaults on there): each
    engine logs the weight file it maps, the same one, and both engine processes map it."""
    import psutil

    paths = re.findall(r"weights: [\d.]+ MiB mapped from (\S+), shared", dp_server.log())
    # (test_server_hardening's dead engine restarts, mapping the same file: a third line)
    assert len(paths) in (2, 3) and len(set(paths)) == 1, paths
    mapping = [p for p in psutil.Process(dp_server.proc.pid).children(recursive=True)
               if any(m.path == paths[0] for m in p.memory_maps())]
    assert len(mapping) == 2, mapping


def test_data_parallel_server_serves_64_streams_on_both_engines(dp_server):
    client = OpenAI(base_url=dp_server.base_url, api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    before, m = _64_streams_a_quarter_disconnecting(dp_server, model)

    def delta(key: str) -> float:
        return m[key] - before.get(key, 0.0)

    served = {}
    for e in ("0", "1"):
        done = sum(delta(f'armserve:request_success_total{{engine="{e}",finished_reason="{r}"}}')
                   for r in ("length", "abort", "stop"))
        served[e] = done
        assert m[f'armserve:num_requests_running{{engine="{e}"}}'] == 0
        assert m[f'armserve:kv_cache_used_blocks{{engine="{e}"}}'] == 0
        assert m[f'vllm:num_requests_running{{engine="{e}"}}'] == 0
    # Nothing lost: every stream is accounted for by exactly one engine, and both took a share.
    assert served["0"] + served["1"] == 64 and min(served.values()) >= 16, served
    total = _summed(m)
    assert total['armserve:request_success_total{finished_reason="length"}'] - \
        _summed(before).get('armserve:request_success_total{finished_reason="length"}', 0) == 48
    assert total['vllm:request_success_total{finished_reason="abort"}'] - \
        _summed(before).get('vllm:request_success_total{finished_reason="abort"}', 0) == 16
    # Each engine process pinned its threads to cores of its own (dp_server is conftest's, shared
    # with test_server_hardening, which kills engine 0: its restart, if that ran first, logs a third
    # line with engine 0's cores).
    pinned = re.findall(r"loaded .* pinned to \[([\d, ]+)\]", dp_server.log())
    assert len(pinned) in (2, 3) and not set(pinned[0].split(", ")) & set(pinned[1].split(", ")), pinned
    assert len(pinned) == 2 or pinned[2] in pinned[:2], pinned
