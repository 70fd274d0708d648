"""The server's front end (HTTP, tokenizing, chat templates, detokenizing) runs without torch or the
model code: its import graph has none, and a running server's API process maps no libtorch while
its engine core does (the check is not vacuous). Its tokenizer, the engine core's own sent over the
pipe, tokenizes as transformers' AutoTokenizer does."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx

ENGINE_MODULES = ("torch", "armserve.models", "armserve.kernels", "armserve.layers", "armserve.model_loader",
                  "armserve.engine.core", "armserve.engine.llm_engine")


def _maps(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as f:
        return f.read()


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def test_frontend_modules_import_no_engine_code():
    """Importing the server, its CLI and building the app's parser loads no torch or model code."""
    code = ("import sys\n"
            "import armserve.entrypoints.server_process, armserve.entrypoints.api_server, armserve.cli\n"
            "armserve.cli.build_parser()\n"
            f"print(sorted(m for m in sys.modules if any(m == e or m.startswith(e + '.') for e in {ENGINE_MODULES!r})))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout[-2000:]


def test_running_server_frontend_has_no_torch(server, tokenizer_dir):
    """After a chat completion and a /tokenize, the API server process has no libtorch mapped; its
    engine core (a child process) has. /tokenize gives AutoTokenizer's ids."""
    from transformers import AutoTokenizer

    name = httpx.get(f"{server.base_url}/models", timeout=30).json()["data"][0]["id"]
    r = httpx.post(f"{server.base_url}/chat/completions", timeout=120,
                   json={"model": name, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 4})
    assert r.status_code == 200, r.text
    text = "The quick brown fox, naïvely: 12345 tokens!"
    got = httpx.post(f"{server.url}/tokenize", json={"prompt": text}, timeout=30).json()["tokens"]
    want = AutoTokenizer.from_pretrained(tokenizer_dir)(text)["input_ids"]
    assert got == want
    pid = server.proc.pid
    assert "libtorch" not in _maps(pid)
    cores = [c for c in _children(pid) if "libtorch" in _maps(c)]
    assert cores, "no engine core child maps libtorch: the check above proves nothing"
    # the kernels the engine runs, reported by the engine (the front end loads none of them)
    from armserve import kernels

    metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
    line = next(ln for ln in metrics.splitlines() if ln.startswith("armserve:kernels_info{"))
    assert f'isa="{kernels.isa()}"' in line and 'available="true"' in line and line.endswith(" 1.0"), line


def test_embedding_server_frontend_has_no_torch(embed_server):
    """Pooled vectors cross to the front end as numpy arrays: embeddings and scores load no torch there."""
    r = httpx.post(f"{embed_server.base_url}/embeddings", json={"model": "minilm", "input": ["a cat", "a dog"]},
                   timeout=60)
    assert r.status_code == 200, r.text
    s = httpx.post(f"{embed_server.url}/score", json={"model": "minilm", "text_1": "a cat", "text_2": ["a cat", "tax"]},
                   timeout=60)
    assert s.status_code == 200, s.text
    scores = [d["score"] for d in s.json()["data"]]
    assert abs(scores[0] - 1.0) < 1e-4 and scores[1] < scores[0]
    assert "libtorch" not in _maps(embed_server.proc.pid)
