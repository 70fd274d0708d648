"""`armserve chat`: a small terminal client that streams answers from a running server.

Standard library only (urllib), so it works wherever armserve is installed, without the
server's dependencies. Commands at the prompt: `/clear` forgets the conversation, `/exit`
(or Ctrl-D) quits.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from typing import Any, Iterator


class ChatClientError(Exception):
    """The server could not be reached or answered with an error."""


def _request(url: str, api_key: str | None, body: dict[str, Any] | None = None, timeout: float = 600):
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream, application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers=headers, method="POST" if data else "GET")
    try:
        return urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError as e:
        try:
            msg = json.loads(e.read())["error"]["message"]
        except Exception:
            msg = e.reason
        raise ChatClientError(f"server error {e.code}: {msg}") from None
    except urllib.error.URLError as e:
        raise ChatClientError(f"cannot reach {url}: {e.reason}") from None


def first_model(base_url: str, api_key: str | None) -> str:
    """The first model the server lists."""
    with _request(f"{base_url}/models", api_key, timeout=30) as resp:
        data = json.loads(resp.read())["data"]
    if not data:
        raise ChatClientError("the server lists no models")
    return data[0]["id"]


def stream_chat(base_url: str, api_key: str | None, body: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """Yield (kind, text) pieces of a streamed chat answer; kind is 'content' or 'reasoning'."""
    with _request(f"{base_url}/chat/completions", api_key, dict(body, stream=True)) as resp:
        for raw in resp:
            line = raw.decode("utf-8").strip()
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                return
            chunk = json.loads(payload)
            if "error" in chunk:
                raise ChatClientError(chunk["error"].get("message", "stream error"))
            for choice in chunk.get("choices", []):
                delta = choice.get("delta", {})
                if delta.get("reasoning_content"):
                    yield "reasoning", delta["reasoning_content"]
                if delta.get("content"):
                    yield "content", delta["content"]


def run_chat(args: argparse.Namespace) -> int:
    base_url = args.url.rstrip("/")
    api_key = args.api_key or os.environ.get("ARMSERVE_API_KEY") or os.environ.get("OPENAI_API_KEY")
    try:
        model = args.model_name or first_model(base_url, api_key)
    except ChatClientError as e:
        print(f"armserve chat: {e}", file=sys.stderr)
        return 1
    system = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
    messages: list[dict[str, str]] = list(system)
    interactive = sys.stdin.isatty() and args.quick is None
    dim, reset = ("\033[2m", "\033[0m") if sys.stdout.isatty() else ("", "")
    if interactive:
        print(f"Chatting with {model} at {base_url}. /clear resets, /exit or Ctrl-D quits.")

    def ask(text: str) -> bool:
        messages.append({"role": "user", "content": text})
        body: dict[str, Any] = {"model": model, "messages": messages, **{
            k: v for k in ("max_tokens", "temperature") if (v := getattr(args, k)) is not None}}
        answer = []
        try:
            for kind, piece in stream_chat(base_url, api_key, body):
                if kind == "reasoning":
                    print(f"{dim}{piece}{reset}", end="", flush=True)
                else:
                    answer.append(piece)
                    print(piece, end="", flush=True)
        except ChatClientError as e:
            messages.pop()
            print(f"\narmserve chat: {e}", file=sys.stderr)
            return False
        print()
        messages.append({"role": "assistant", "content": "".join(answer)})
        return True

    if args.quick is not None:
        return 0 if ask(args.quick) else 1
    ok = True
    while True:
        try:
            line = input("> " if interactive else "")
        except (EOFError, KeyboardInterrupt):
            if interactive:
                print()
            return 0 if ok else 1
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            return 0 if ok else 1
        if line == "/clear":
            messages[:] = list(system)
            continue
        try:
            ok = ask(line) and ok
        except KeyboardInterrupt:  # stop this answer, keep the session
            print()
            messages.pop()
