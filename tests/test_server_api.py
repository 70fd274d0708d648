"""The smaller API surface of `armserve serve` (vLLM's names): --tokenizer, HTTPS (--ssl-*),
--root-path, --max-logprobs, --generation-config, --enable/--disable-log-requests, /ping, /load,
/tokenize with tools, completions' suffix (fill-in-the-middle) and best_of, return_token_ids, and
the vllm:* series iteration_tokens_total, inter_token_latency_seconds, request_prefill_time_seconds,
request_decode_time_seconds and cache_config_info.

One server serves them all: a tiny random Qwen2 whose tokenizer has Qwen2.5-Coder's FIM tokens,
from a folder without a tokenizer (--tokenizer gives it), over HTTPS with a certificate made here.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import shutil
import socket
import time

import httpx
import openai
import pytest
from conftest import CACHE, make_tiny_checkpoint
from prometheus_client.parser import text_string_to_metric_families
from server_process import ServerProcess

FIM = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")
API_KEY = "api-small-key"
ROOT = "/api"
MAX_LOGPROBS = 5
BLOCK_SIZE = 16
# The folder's generation_config.json: the defaults of requests that leave these out.
GENERATION = {"temperature": 0.5, "top_p": 0.9, "top_k": 7, "repetition_penalty": 1.1, "max_new_tokens": 6,
              "bos_token_id": 0, "do_sample": True}
# A template that writes the tools out, as Qwen2.5's does (SmolLM2's ignores them).
TOOLS_TEMPLATE = ("{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n"
                  "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]

# vLLM's buckets of these series
ITERATION_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
PHASE_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                 480.0, 960.0, 1920.0, 7680.0]


@pytest.fixture(scope="module")
def fim_tokenizer_dir(tokenizer_dir) -> str:
    """SmolLM2's tokenizer plus Qwen2.5-Coder's three FIM tokens."""
    out = os.path.join(CACHE, "smollm2-tokenizer-fim")
    if not os.path.isfile(os.path.join(out, "tokenizer.json")):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer_dir)
        tok.add_special_tokens({"additional_special_tokens": list(FIM)})
        tmp = out + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tok.save_pretrained(tmp)
        os.replace(tmp, out)
    return out


@pytest.fixture(scope="module")
def bare_qwen(fim_tokenizer_dir, tmp_path_factory) -> str:
    """The tiny FIM Qwen2's weights and config only (no tokenizer), with GENERATION's defaults."""
    full = make_tiny_checkpoint(os.path.join(CACHE, "tiny-qwen2-fim"), "Qwen2ForCausalLM", fim_tokenizer_dir)
    bare = tmp_path_factory.mktemp("bare-qwen")
    for name in ("config.json", "model.safetensors"):
        os.symlink(os.path.join(full, name), bare / name)
    (bare / "generation_config.json").write_text(json.dumps(GENERATION))
    return str(bare)


def self_signed_cert(folder) -> tuple[str, str]:
    """(key file, certificate file) of a self-signed certificate for 127.0.0.1, made with cryptography."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "armserve test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(key, hashes.SHA256()))
    key_file, cert_file = folder / "key.pem", folder / "cert.pem"
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(key_file), str(cert_file)


@pytest.fixture(scope="module")
def api_server(bare_qwen, fim_tokenizer_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("api-small")
    key, cert = self_signed_cert(folder)
    template = folder / "tools.jinja"
    template.write_text(TOOLS_TEMPLATE)
    srv = ServerProcess(bare_qwen, ["--kv-cache-space", "0.02", "--block-size", str(BLOCK_SIZE), "--served-model-name",
                                    "qwen", "--tokenizer", fim_tokenizer_dir, "--ssl-keyfile", key, "--ssl-certfile",
                                    cert, "--root-path", ROOT, "--api-key", API_KEY, "--max-logprobs",
                                    str(MAX_LOGPROBS), "--enable-log-requests", "--chat-template", str(template),
                                    "--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
                        str(folder / "server.log"), https_ca=cert)
    yield srv
    srv.stop()


def client(srv: ServerProcess) -> openai.OpenAI:
    """The official client over HTTPS, trusting the test's certificate, under the proxy prefix."""
    return openai.OpenAI(base_url=f"{srv.url}{ROOT}/v1", api_key=API_KEY,
                         http_client=httpx.Client(verify=srv.verify, timeout=60))


def http(srv: ServerProcess) -> httpx.Client:
    return httpx.Client(base_url=srv.url, verify=srv.verify, timeout=60,
                        headers={"Authorization": f"Bearer {API_KEY}"})


def error_of(e: openai.APIStatusError) -> dict:
    return e.response.json()["error"]


# ---- HTTPS, --root-path, --tokenizer ----------------------------------------------------------


def test_https_under_root_path_keeps_the_api_key(api_server):
    assert [m.id for m in client(api_server).models.list().data] == ["qwen"]
    with httpx.Client(base_url=api_server.url, verify=api_server.verify) as h:
        # the prefix must not get a request past the key check, nor its absence (a proxy that strips it)
        for path in (f"{ROOT}/v1/models", "/v1/models"):
            assert h.get(path).status_code == 401
            assert h.get(path, headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
        assert h.get(f"{ROOT}/openapi.json").json()["servers"] == [{"url": ROOT}]
    with pytest.raises(httpx.HTTPError):  # plain HTTP is not served
        httpx.get(api_server.url.replace("https:", "http:") + "/health", timeout=5)


def test_tokenizer_flag_tokenizes_as_transformers(api_server, fim_tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(fim_tokenizer_dir)
    text = "def add(a, b):<|fim_suffix|> return a + b"
    with http(api_server) as h:
        got = h.post(f"{ROOT}/tokenize", json={"prompt": text}).json()
    assert got["tokens"] == tok(text)["input_ids"]
    assert tok.convert_tokens_to_ids("<|fim_suffix|>") in got["tokens"]


def test_llm_tokenizer_argument(bare_qwen, fim_tokenizer_dir):
    """LLM(tokenizer=...), here the tokenizer.json file of a folder (the server takes the folder)."""
    from transformers import AutoTokenizer

    from armserve import LLM, SamplingParams

    tok = AutoTokenizer.from_pretrained(fim_tokenizer_dir)
    llm = LLM(bare_qwen, tokenizer=os.path.join(fim_tokenizer_dir, "tokenizer.json"), kv_cache_space=0.01,
              enforce_eager=True)
    out = llm.generate(["hello <|fim_middle|>"], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)[0]
    assert out.prompt_token_ids == tok("hello <|fim_middle|>")["input_ids"]


def test_tokenizer_that_cannot_load_is_named(bare_qwen, tmp_path):
    from armserve.model_loader import ModelLoadError, load_tokenizer, resolve_model_path

    src = resolve_model_path(bare_qwen)
    (tmp_path / "vocab.txt").write_text("a\n")
    with pytest.raises(ModelLoadError, match="neither a folder, a GGUF file nor a tokenizer.json"):
        load_tokenizer(src, str(tmp_path / "vocab.txt"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="cannot load the tokenizer"):
        load_tokenizer(src, str(tmp_path / "empty"))
    # the bare folder has none (transformers would make one without a vocabulary from config.json)
    with pytest.raises(ModelLoadError, match="--tokenizer"):
        load_tokenizer(src)


# ---- --max-logprobs, --generation-config, --enable-log-requests ------------------------------


def test_max_logprobs(api_server):
    c = client(api_server)
    ok = c.completions.create(model="qwen", prompt="Hello", max_tokens=2, logprobs=MAX_LOGPROBS)
    assert all(len(top) == MAX_LOGPROBS for top in ok.choices[0].logprobs.top_logprobs)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="qwen", prompt="Hello", max_tokens=2, logprobs=MAX_LOGPROBS + 1)
    assert error_of(e.value)["param"] == "logprobs" and "--max-logprobs" in error_of(e.value)["message"]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="qwen", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                  logprobs=True, top_logprobs=MAX_LOGPROBS + 1)
    assert error_of(e.value)["param"] == "top_logprobs" and "--max-logprobs" in error_of(e.value)["message"]


def _logged_params(srv: ServerProcess, request_id: str) -> str:
    line = next(ln for ln in srv.log().splitlines() if f"Received request {request_id}:" in ln)
    return line.split("params: ", 1)[1]


def test_generation_config_defaults_and_request_log(api_server):
    c = client(api_server)
    # left out: the folder's generation_config.json (and max_new_tokens is the length)
    r = c.completions.create(model="qwen", prompt="Once upon", extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == GENERATION["max_new_tokens"] and r.choices[0].finish_reason == "length"
    logged = _logged_params(api_server, r.id)
    for name in ("temperature", "top_p", "top_k", "repetition_penalty"):
        assert f"{name}={GENERATION[name]!r}" in logged, (name, logged)
    # given: the request's values; its max_tokens is capped by max_new_tokens, as vLLM does
    r = c.completions.create(model="qwen", prompt="Once upon", temperature=0, max_tokens=50, top_p=1.0,
                             extra_body={"ignore_eos": True, "top_k": 3})
    assert r.usage.completion_tokens == GENERATION["max_new_tokens"]
    logged = _logged_params(api_server, r.id)
    assert "temperature=0.0" in logged and "top_k=3" in logged and "top_p=1.0" in logged
    assert "repetition_penalty=1.1" in logged
    r = c.chat.completions.create(model="qwen", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert "temperature=0.5" in _logged_params(api_server, r.id)


def test_log_requests_flags():
    from armserve.cli import build_parser

    parse = build_parser().parse_args
    assert parse(["serve"]).log_requests is False
    assert parse(["serve", "--enable-log-requests"]).log_requests is True
    assert parse(["serve", "--enable-log-requests", "--disable-log-requests"]).log_requests is False


def test_generation_defaults_sources(bare_qwen, tmp_path):
    from armserve.config import ConfigError, EngineConfig
    from armserve.model_loader import ModelLoadError, generation_defaults

    auto = generation_defaults(bare_qwen)
    assert auto == {"temperature": 0.5, "top_p": 0.9, "top_k": 7, "repetition_penalty": 1.1, "max_tokens": 6}
    assert generation_defaults(bare_qwen, "vllm") == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.2, "top_k": "many"}))
    assert generation_defaults(bare_qwen, str(tmp_path)) == {"temperature": 0.2}
    with pytest.raises(ModelLoadError, match="no generation_config.json"):
        generation_defaults(bare_qwen, str(tmp_path / ".."))
    with pytest.raises(ConfigError, match="generation_config"):
        EngineConfig(model=bare_qwen, generation_config=str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="max_logprobs"):
        EngineConfig(model=bare_qwen, max_logprobs=-2)


# ---- /ping, /load, /tokenize with tools -------------------------------------------------------


def test_ping_and_load(api_server):
    with http(api_server) as h:
        assert h.get("/ping").status_code == 200 and h.post("/ping").status_code == 200
        assert h.get(f"{ROOT}/ping").status_code == 200

        def load_becomes(n: int) -> bool:
            deadline = time.monotonic() + 30
            while h.get("/load").json() != {"server_load": n} and time.monotonic() < deadline:
                time.sleep(0.05)
            return h.get("/load").json() == {"server_load": n}

        assert load_becomes(0)
        # A completion whose body is still arriving is in flight until its client leaves.
        head = (f"POST {ROOT}/v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\n"
                "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
        with socket.create_connection(("127.0.0.1", api_server.port)) as raw, \
                api_server.verify.wrap_socket(raw, server_hostname="127.0.0.1") as conn:
            conn.sendall(head.encode())
            assert load_becomes(1)
        assert load_becomes(0)


def test_tokenize_counts_tools_as_chat_does(api_server):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    chat = client(api_server).chat.completions.create(model="qwen", messages=messages, tools=TOOLS, max_tokens=1)
    with http(api_server) as h:
        with_tools = h.post("/tokenize", json={"messages": messages, "tools": TOOLS}).json()
        without = h.post("/tokenize", json={"messages": messages}).json()
        bad = h.post("/tokenize", json={"prompt": "x", "tools": TOOLS})
    assert with_tools["count"] == chat.usage.prompt_tokens
    assert with_tools["count"] > without["count"]
    assert bad.status_code == 400 and "tools" in bad.json()["error"]["message"]


# ---- completions: suffix (fill-in-the-middle), best_of ----------------------------------------


def test_suffix_builds_the_fim_prompt(api_server, fim_tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(fim_tokenizer_dir)
    prefix, suffix = "def add(a, b):\n    ", "\n\nprint(add(1, 2))\n"
    r = client(api_server).completions.create(model="qwen", prompt=prefix, suffix=suffix, max_tokens=3,
                                              extra_body={"return_token_ids": True})
    # Qwen2.5-Coder's documented layout, tokenized by transformers
    expected = tok(f"<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>")["input_ids"]
    choice = r.choices[0].model_dump()
    assert choice["prompt_token_ids"] == expected
    assert r.usage.prompt_tokens == len(expected)
    assert len(choice["token_ids"]) == r.usage.completion_tokens
    # a token-id prompt goes between the markers as given
    ids = tok(prefix)["input_ids"]
    r = client(api_server).completions.create(model="qwen", prompt=ids, suffix=suffix, max_tokens=1,
                                              extra_body={"return_token_ids": True})
    assert r.choices[0].model_dump()["prompt_token_ids"] == expected
    # streamed: the prompt's ids in the first chunk, each chunk's new ids
    chunks = [c.choices[0].model_dump() for c in client(api_server).completions.create(
        model="qwen", prompt=prefix, suffix=suffix, max_tokens=3, stream=True,
        extra_body={"return_token_ids": True, "ignore_eos": True})
        if c.choices]
    assert chunks[0]["prompt_token_ids"] == expected and all(c["prompt_token_ids"] is None for c in chunks[1:])
    assert sum(len(c["token_ids"]) for c in chunks) == 3


def test_suffix_on_a_model_without_fim_tokens(server):
    c = openai.OpenAI(base_url=server.base_url, api_key="none")
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=c.models.list().data[0].id, prompt="def f():", suffix="return 1", max_tokens=2)
    assert error_of(e.value)["param"] == "suffix" and "fill-in-the-middle" in error_of(e.value)["message"]


def test_best_of_returns_the_n_most_likely(api_server):
    c = client(api_server)
    kw = dict(model="qwen", prompt="The weather today", max_tokens=4, temperature=1.0, seed=11,
              extra_body={"ignore_eos": True})
    # the same seeds: the best_of candidates are these n=4 completions
    every = c.completions.create(n=4, logprobs=0, **kw)
    score = {ch.text: sum(ch.logprobs.token_logprobs) for ch in every.choices}
    assert len(score) > 2  # distinct candidates, or the ranking proves nothing
    best = c.completions.create(n=2, best_of=4, **kw)
    assert [ch.text for ch in best.choices] == sorted(score, key=score.get, reverse=True)[:2]
    assert [ch.index for ch in best.choices] == [0, 1]
    assert all(ch.logprobs is None for ch in best.choices)  # not asked for
    assert best.usage.completion_tokens == 2 * 4
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(n=2, best_of=4, stream=True, **kw)
    assert "best_of" in error_of(e.value)["message"]
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(n=3, best_of=2, **kw)
    assert "best_of" in error_of(e.value)["message"]


# ---- the vllm:* series ------------------------------------------------------------------------


def _families(srv: ServerProcess) -> dict:
    with http(srv) as h:
        return {f.name: f for f in text_string_to_metric_families(h.get("/metrics").text)}


def _hist(fams: dict, name: str) -> tuple[list[float], float, float]:
    """(bucket bounds, count, sum) of a histogram (one engine)."""
    samples = fams[name].samples
    bounds = [float(s.labels["le"]) for s in samples if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"]
    count = sum(s.value for s in samples if s.name.endswith("_count"))
    total = sum(s.value for s in samples if s.name.endswith("_sum"))
    return bounds, count, total


def test_vllm_series(api_server):
    before = _families(api_server)
    for name, buckets in (("vllm:iteration_tokens_total", ITERATION_BUCKETS), ("vllm:inter_token_latency_seconds",
                          ITL_BUCKETS), ("vllm:request_prefill_time_seconds", PHASE_BUCKETS),
                          ("vllm:request_decode_time_seconds", PHASE_BUCKETS)):
        assert before[name].type == "histogram"
        assert _hist(before, name)[0] == buckets, name
        assert {"model_name", "engine"} <= set(before[name].samples[0].labels)
    k = 5
    r = client(api_server).completions.create(model="qwen", prompt=f"A unique prompt {time.time()}", max_tokens=k,
                                              extra_body={"ignore_eos": True})
    computed = r.usage.prompt_tokens - r.usage.prompt_tokens_details.cached_tokens + r.usage.completion_tokens

    def delta(name: str) -> tuple[float, float]:
        _, c0, s0 = _hist(before, name)
        _, c1, s1 = _hist(after, name)
        return c1 - c0, s1 - s0

    deadline = time.monotonic() + 30  # (the stats of the last step may land just after the response)
    while True:
        after = _families(api_server)
        if delta("vllm:request_decode_time_seconds")[0] >= 1 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert delta("vllm:iteration_tokens_total")[1] == computed
    assert delta("vllm:inter_token_latency_seconds")[0] == k - 1
    assert delta("vllm:request_prefill_time_seconds")[0] == 1
    assert delta("vllm:request_decode_time_seconds")[0] == 1
    e2e = delta("vllm:e2e_request_latency_seconds")[1]
    assert 0 <= delta("vllm:request_decode_time_seconds")[1] <= e2e
    assert abs(delta("vllm:inter_token_latency_seconds")[1] - delta("vllm:request_decode_time_seconds")[1]) < 1e-6

    info = after["vllm:cache_config_info"]
    assert info.type == "gauge"
    (sample,) = info.samples
    assert sample.value == 1 and sample.labels["engine"] == "0"
    assert sample.labels["block_size"] == str(BLOCK_SIZE) and sample.labels["enable_prefix_caching"] == "True"
    total_blocks = next(s.value for s in after["armserve:kv_cache_total_blocks"].samples)
    assert int(sample.labels["num_gpu_blocks"]) == total_blocks
