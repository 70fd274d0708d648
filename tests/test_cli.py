"""`armserve generate` end to end, as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from transformers import AutoTokenizer


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "armserve.cli", *args], capture_output=True, text=True,
                          env=env, timeout=300)


def test_generate_json_output(tiny_llama):
    r = run_cli("generate", "--model", tiny_llama, "--dtype", "float32", "--kv-cache-space", "0.01",
                "--prompt", "hello", "--prompt", "world", "--max-tokens", "5", "--temperature", "0",
                "--ignore-eos", "--json")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert [row["prompt"] for row in rows] == ["hello", "world"]
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    for row in rows:
        assert len(row["token_ids"]) == 5 and row["finish_reason"] == "length"
        assert row["text"] == tok.decode(row["token_ids"], skip_special_tokens=True)


def test_generate_reports_bad_input(tiny_llama, tmp_path):
    r = run_cli("generate", "--model", str(tmp_path / "missing"), "--prompt", "x")
    assert r.returncode == 2 and "does not exist" in r.stderr
    r = run_cli("generate", "--model", tiny_llama, "--top-p", "0", "--prompt", "x")
    assert r.returncode == 2 and "top_p" in r.stderr


def test_serve_refuses_an_unknown_tool_parser_before_loading(tiny_llama):
    r = run_cli("serve", tiny_llama, "--port", "0", "--tool-call-parser", "nope")
    assert r.returncode == 2 and "unknown tool call parser 'nope'; choose from hermes" in r.stderr
    r = run_cli("serve", tiny_llama, "--port", "0", "--enable-auto-tool-choice")
    assert r.returncode == 2 and "--enable-auto-tool-choice needs --tool-call-parser" in r.stderr
