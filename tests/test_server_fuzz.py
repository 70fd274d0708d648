"""Every route of `armserve serve` fuzzed with schemathesis from the server's own /openapi.json:
request bodies that fit each route's schema and bodies that break it (wrong types, missing and
extra fields, out-of-range numbers, odd strings), path parameters, query strings.

What must hold for every one of them: no 5xx (schemathesis' `not_a_server_error`); a body the
schema forbids is refused with a 4xx (`negative_data_rejection`); every error is the OpenAI-shaped
JSON error the clients read. Afterwards the server still answers a plain request with the same
greedy text as before the fuzzing and holds no KV cache block.
"""

from __future__ import annotations

import os

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import negative_data_rejection, not_a_server_error

# Generation stays short whatever the fuzzer asks for (the tiny model's 512-token context still
# bounds it): the fuzz is about what the server accepts and refuses, not about long outputs.
MAX_TOKENS_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
MAX_TOKENS = 4
# Examples per route: a few hundred requests in all for the suite (seconds, the same ones every run);
# ARMSERVE_FUZZ_EXAMPLES=200 ARMSERVE_FUZZ_SEED=random for a deeper run of new ones.
EXAMPLES = int(os.environ.get("ARMSERVE_FUZZ_EXAMPLES", "12"))
DERANDOMIZE = os.environ.get("ARMSERVE_FUZZ_SEED", "fixed") != "random"
SEEN: dict[str, int] = {}  # (status class or "stream") -> responses: what the fuzz reached


@pytest.fixture(scope="module")
def api_schema(server):
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    schema.config.update(base_url=server.url)
    return schema


# each generating route's length field, set when the fuzzer left it out or null (else the default is
# the rest of the context: 0.2 s a request on the tiny model, 9 s of the run on /v1/responses)
LENGTH_FIELD = {"/v1/completions": "max_tokens", "/v1/chat/completions": "max_completion_tokens",
                "/v1/responses": "max_output_tokens"}


def cap_lengths(path: str, body) -> None:
    """Cap the generated lengths in place (only where the fuzzer made them numbers in range, or left
    them out or null). (Done on each case, not in a schemathesis hook: the coverage phase's cases do
    not go through the hooks.)"""
    if isinstance(body, dict):
        field = LENGTH_FIELD.get(path)
        if field and all(body.get(key) is None for key in MAX_TOKENS_FIELDS):  # (absent or null)
            body[field] = MAX_TOKENS
        for key in MAX_TOKENS_FIELDS:
            if isinstance(body.get(key), int) and not isinstance(body.get(key), bool) and body[key] > MAX_TOKENS:
                body[key] = MAX_TOKENS
        if isinstance(body.get("n"), int) and not isinstance(body.get("n"), bool) and body["n"] > 2:
            body["n"] = 2


schema = schemathesis.pytest.from_fixture("api_schema")


def _greedy(server) -> str:
    model = httpx.get(f"{server.base_url}/models", timeout=30).json()["data"][0]["id"]
    r = httpx.post(f"{server.base_url}/completions", json={"model": model, "prompt": "Hello, my name is",
                                                          "max_tokens": 8, "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def before(server):
    return _greedy(server)


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, derandomize=DERANDOMIZE, database=None,
          suppress_health_check=list(HealthCheck))
def test_no_route_answers_a_fuzzed_request_with_a_server_error(case, before):
    cap_lengths(case.path, case.body)
    response = case.call(timeout=60)
    SEEN[f"{response.status_code // 100}xx"] = SEEN.get(f"{response.status_code // 100}xx", 0) + 1
    case.validate_response(response, checks=(not_a_server_error, negative_data_rejection))
    content_type = (response.headers.get("content-type") or [""])[0]  # (schemathesis: each header's values)
    if response.status_code >= 400 and content_type.startswith("application/json"):
        body = response.json()
        # OpenAI's error shape ({"error": {"message", "type", ...}}), or Anthropic's on /v1/messages
        # ({"type": "error", "error": {...}}): either way a message a client can show
        error = body.get("error") if isinstance(body, dict) else None
        assert isinstance(error, dict) and isinstance(error.get("message"), str) and error["message"], body
    if response.status_code == 200 and content_type.startswith("text/event-stream"):
        # A stream the server accepted ends well: bad input is refused before the first event, so an
        # error event inside a 200 stream is the server failing (a 500 the status line cannot show).
        import json

        SEEN["stream"] = SEEN.get("stream", 0) + 1
        for line in response.text.splitlines():
            if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"):
                event = json.loads(line[5:])
                assert "error" not in event and event.get("type") != "error", (case.path, event)


def test_the_server_is_unchanged_after_the_fuzzing(server, before):
    """(Runs after the fuzz, in file order.) Same greedy text, no block held, healthy; and the fuzz
    reached both sides: accepted requests (streamed ones among them) and refused ones."""
    import time

    if SEEN:  # (the fuzz ran in this process: not with -k picking this test alone)
        assert SEEN.get("2xx", 0) >= 20 and SEEN.get("4xx", 0) >= 20 and SEEN.get("stream", 0) >= 1, SEEN

    assert _greedy(server) == before
    deadline = time.monotonic() + 30
    while (used := server.metrics().get("armserve:kv_cache_used_blocks")) != 0:
        assert used is not None and time.monotonic() < deadline, used
        time.sleep(0.5)
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
