"""Stateful Responses API with the official `openai` client: `store`, `previous_response_id` (the
continuation's prompt and greedy text equal a chat request carrying the whole history), retrieve,
delete, 404s in OpenAI's shape, the store's LRU bounds, and a SQLite store that survives a restart."""

from __future__ import annotations

import os
import subprocess
import sys

import openai
import pytest
from openai import OpenAI

from armserve.entrypoints.response_store import ResponseStore
from server_process import ServerProcess


def client_of(srv) -> OpenAI:
    return OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=120)


def test_continuation_equals_chat_with_the_whole_history(smollm2_server):
    client = client_of(smollm2_server)
    first = client.responses.create(model="smollm2", input="My name is Ada. Say hello to me.", max_output_tokens=16,
                                    temperature=0)
    assert first.store is True
    follow = client.responses.create(model="smollm2", input="What is my name?", previous_response_id=first.id,
                                     instructions="Answer in one sentence.", max_output_tokens=16, temperature=0)
    assert follow.previous_response_id == first.id
    chat = client.chat.completions.create(
        model="smollm2", max_tokens=16, temperature=0,
        messages=[{"role": "system", "content": "Answer in one sentence."},
                  {"role": "user", "content": "My name is Ada. Say hello to me."},
                  {"role": "assistant", "content": first.output_text},
                  {"role": "user", "content": "What is my name?"}])
    assert follow.usage.input_tokens == chat.usage.prompt_tokens
    assert follow.output_text == chat.choices[0].message.content
    # Instructions are not carried over (as OpenAI): a third turn without them renders no system message.
    third = client.responses.create(model="smollm2", input="Thanks.", previous_response_id=follow.id,
                                    max_output_tokens=4, temperature=0)
    without = client.chat.completions.create(model="smollm2", max_tokens=4, temperature=0, messages=chat_history(
        ["My name is Ada. Say hello to me.", first.output_text, "What is my name?", follow.output_text, "Thanks."]))
    assert third.usage.input_tokens == without.usage.prompt_tokens

    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text
    client.responses.delete(first.id)
    for call in (lambda: client.responses.retrieve(first.id), lambda: client.responses.delete(first.id),
                 lambda: client.responses.create(model="smollm2", input="x", previous_response_id=first.id)):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert first.id in e.value.body["message"]
    # store=False keeps nothing; a streamed response is stored once it completes.
    unstored = client.responses.create(model="smollm2", input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    events = list(client.responses.create(model="smollm2", input="Hi", max_output_tokens=4, temperature=0,
                                          stream=True))
    done = events[-1].response
    assert client.responses.retrieve(done.id).output_text == done.output_text


def chat_history(texts: list[str]) -> list[dict[str, str]]:
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(texts)]


@pytest.mark.parametrize("on_disk", [False, True])
def test_store_bounds_evict_least_recently_used(tmp_path, on_disk):
    path = str(tmp_path / "r.db") if on_disk else None
    store = ResponseStore(path, max_entries=3)
    for rid in "abc":
        store.put(rid, {"response": {"id": rid}, "messages": []})
    assert store.get("a") is not None  # a is now the most recently used
    store.put("d", {"response": {"id": "d"}, "messages": []})
    assert [store.get(r) is not None for r in "abcd"] == [True, False, True, True]
    assert len(store) == 3 and store.delete("a") and not store.delete("a") and len(store) == 2
    # The byte bound: room for two entries of ~250 bytes of JSON, not three.
    small = ResponseStore(str(tmp_path / "s.db") if on_disk else None, max_bytes=500)
    for rid in "xyz":
        assert small.put(rid, {"response": {"id": rid, "text": "a" * 200}, "messages": []})
    assert [small.get(r) is not None for r in "xyz"] == [False, True, True]
    assert not small.put("big", {"response": {"text": "a" * 1000}, "messages": []})  # larger than the whole store
    small.close()
    store.close()


def test_sqlite_store_survives_a_restart(tiny_llama, tmp_path):
    db = str(tmp_path / "responses.db")
    args = ["--kv-cache-space", "0.02", "--served-model-name", "tiny", "--responses-store", db]
    env = {"ARMSERVE_RESPONSES_STORE_MAX_ENTRIES": "2"}
    srv = ServerProcess(tiny_llama, args, str(tmp_path / "a.log"), env=env)
    try:
        client = client_of(srv)
        r1, r2, r3 = (client.responses.create(model="tiny", input=f"Turn {i}", max_output_tokens=3, temperature=0)
                      for i in range(3))
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(r1.id)  # past the bound of 2: the least recently used went
        client.responses.retrieve(r2.id)
    finally:
        srv.stop()
    srv = ServerProcess(tiny_llama, args, str(tmp_path / "b.log"), env=env)
    try:
        client = client_of(srv)
        assert client.responses.retrieve(r3.id).output_text == r3.output_text
        assert client.responses.retrieve(r2.id).output_text == r2.output_text  # now r3 is the least recent
        r4 = client.responses.create(model="tiny", input="Go on", previous_response_id=r2.id, max_output_tokens=3,
                                     temperature=0)
        alone = client.responses.create(model="tiny", input="Go on", max_output_tokens=3, temperature=0, store=False)
        assert r4.usage.input_tokens > alone.usage.input_tokens  # the stored turn is in the prompt
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(r3.id)
    finally:
        srv.stop()


def test_an_unusable_store_file_is_refused_before_loading(tiny_llama, tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("not a database, just text\n" * 100)
    for path, why in ((str(text), "file is not a database"), (str(tmp_path / "no" / "dir.db"), "unable to open")):
        r = subprocess.run([sys.executable, "-m", "armserve.cli", "serve", tiny_llama, "--port", "0",
                            "--responses-store", path], capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert r.returncode == 2 and f"--responses-store {path}: cannot use it" in r.stderr and why in r.stderr
        assert "loaded" not in r.stderr + r.stdout
