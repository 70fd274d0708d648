"""Open WebUI's RAG against armserve, end to end in a real browser (issue 32's client check).

    python3 scripts/webui_rag_check.py [--screenshots DIR]

Installs Open WebUI and playwright into ~/.cache/armserve-peers/open-webui (benchmarks/peers.py,
torch 2.13.0 CPU first), needs Debian's headless Chromium (`apt-get install -y chromium`; playwright's
own browser download is not used), and then:

1. serves Qwen2.5-Coder-0.5B-Instruct (chat) and all-MiniLM-L6-v2 (`--task embed`) with armserve;
2. starts Open WebUI offline, with armserve as its OpenAI connection and as its RAG embedding engine;
3. in Chromium: uploads a document with a made-up fact into a new chat, asks about it, waits for
   the answer and checks that it names the fact;
4. checks on armserve's /metrics that Open WebUI's embedding calls went to armserve: every chunk of
   the document when it was uploaded, the question when it was asked.

Not part of the test suite (it installs ~3 GB and runs for minutes). Exit status 0 when every check
holds; a summary is printed either way, and the run folder (logs, screenshots) is kept.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

CODENAME = "VELVET-MARMOT-42"
QUESTION = "What is the codename of the Zephyrine lighthouse retrofit?"
FILLER = [
    "The harbour bakery opens at six and sells rye bread, cardamom buns and a dense almond cake that "
    "fishermen buy by the slice before the morning tide. Its ovens burn beech wood delivered every Tuesday.",
    "Allotment 14 grows runner beans on bamboo canes, three rows of leeks and a stubborn rhubarb crown. "
    "The gardeners share one green water butt and argue every spring about slug pellets.",
    "The branch railway closed in 1963 and its cutting is now a footpath. Walkers pass the old signal box, "
    "which the parish council repainted in cream and maroon, its original colours.",
    "The sailing club races dinghies on Sunday afternoons from May to September. Its committee boat is an "
    "old launch with a brass bell, and the results go up on a chalkboard by the slipway.",
    "The village choir rehearses in the school hall on Thursday evenings. This year it is learning a "
    "madrigal cycle and a set of sea shanties for the autumn concert in the church.",
    "The museum's fossil room holds ammonites from the cliffs, a plesiosaur vertebra and a case of "
    "belemnites. Volunteers clean the finds with soft brushes and label them in pencil.",
]
FACT = (f"The Zephyrine lighthouse retrofit, which replaces the lamp with a solar array, has the internal "
        f"codename {CODENAME}. Only the harbour engineers use that codename.")

# Open WebUI's settings (names as in open_webui/config.py and env.py of the installed release).
CHUNK_SIZE = 300  # each paragraph of the document is one chunk: the fact is in one of seven
TOP_K = 2  # fewer than the chunks: the answer needs the retrieval to rank the fact's chunk first


def document(path: str) -> None:
    paragraphs = FILLER[:3] + [FACT] + FILLER[3:]
    with open(path, "w") as f:
        f.write("Harbour notes\n\n" + "\n\n".join(paragraphs) + "\n")


def embed_counts(url: str) -> dict[str, float]:
    """Embedding HTTP calls, texts embedded and their tokens, from an armserve server's /metrics."""
    import httpx

    text = httpx.get(url + "/metrics", timeout=30).text

    def total(pattern: str) -> float:
        return sum(float(m.group(1)) for m in re.finditer(pattern + r"[^\n]* ([0-9.e+]+)\n", text))

    return {"calls": total(r'armserve:http_requests_total\{handler="/v1/embeddings",method="POST",status="200"\}'),
            "texts": total(r'vllm:request_success_total\{[^}]*finished_reason="stop"'),
            "tokens": total(r"vllm:prompt_tokens_total\{")}


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, int]:
    return {k: int(after[k] - before[k]) for k in after}


# ---- the browser (runs in Open WebUI's venv, where playwright is) --------------------------------


def drive(url: str, doc: str, shots: str, embed_url: str, chromium: str) -> None:
    """Upload `doc` in a new chat, ask QUESTION, print one JSON line with the answer and the
    embedding counts measured around each step."""
    from playwright.sync_api import sync_playwright

    def shot(page, name: str) -> None:
        page.screenshot(path=os.path.join(shots, f"{name}.png"))

    result: dict = {}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True,
                                    args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.set_default_timeout(120_000)
        page.goto(url)
        page.wait_for_selector("#chat-input", timeout=300_000)
        # A first visit may open the release notes; close them.
        for label in ("Okay, Let's Go!", "Okay, Let’s Go!"):
            button = page.get_by_role("button", name=label)
            if button.count():
                button.first.click()
        shot(page, "1-new-chat")

        before_upload = embed_counts(embed_url)
        page.locator("input[type=file]").first.set_input_files(doc)
        page.get_by_text(os.path.basename(doc)).first.wait_for()
        # Open WebUI extracts, splits and embeds the file in the background (one call per chunk):
        # done when armserve has embedded something and the count has not moved for 5 s.
        deadline, last, still_since = time.monotonic() + 600, before_upload, time.monotonic()
        while True:
            time.sleep(1)
            now = embed_counts(embed_url)
            if now != last:
                last, still_since = now, time.monotonic()
            elif now["texts"] > before_upload["texts"] and time.monotonic() - still_since > 5:
                break
            if time.monotonic() > deadline:
                shot(page, "error-upload")
                raise TimeoutError("the document was not embedded within 600 s")
        after_upload = last
        shot(page, "2-uploaded")

        page.locator("#chat-input").click()
        page.keyboard.type(QUESTION)
        page.keyboard.press("Enter")
        # While the answer streams the input has a Stop button; the message's action row (Copy,
        # Regenerate, ...) comes once it is complete. A new chat has one answer.
        assistant = page.locator(".chat-assistant").last
        try:
            page.locator("button[aria-label='Regenerate']").wait_for(state="attached", timeout=1_800_000)
        except Exception:
            shot(page, "error-answer")
            raise
        prose = assistant.locator(".markdown-prose")
        answer = prose.inner_text() if prose.count() else assistant.inner_text()  # else: an error box
        shot(page, "3-answer")
        page.screenshot(path=os.path.join(shots, "answer.png"), clip={"x": 0, "y": 0, "width": 1280, "height": 340})
        after_answer = embed_counts(embed_url)
        result = {"answer": answer.strip(), "chunks": delta(after_upload, before_upload),
                  "query": delta(after_answer, after_upload)}
        browser.close()
    print("RESULT " + json.dumps(result), flush=True)


# ---- the run ---------------------------------------------------------------------------------------

# Open WebUI's default RAG template leads with a citation example ("... increases efficiency by 20%
# [1]") that a 0.5B model repeats instead of answering (transformers' greedy decode of the same
# prompt does the same): a plain one. Open WebUI puts the question after it.
RAG_TEMPLATE = "Answer the user's question using only the context below.\n\n<context>\n{{CONTEXT}}\n</context>"


def open_webui_env(data_dir: str, chat_url: str, embed_url: str) -> dict[str, str]:
    """Open WebUI offline, armserve as its OpenAI connection and its RAG embedding engine."""
    return {
        "DATA_DIR": data_dir,
        "WEBUI_AUTH": "false",  # one local user, no sign-in page
        # Open WebUI also makes a Fernet key of it: 32 bytes, url-safe base64. Not a secret: loopback only.
        "WEBUI_SECRET_KEY": base64.urlsafe_b64encode(b"armserve open webui check key 32").decode(),
        "ENABLE_OLLAMA_API": "false",
        "OPENAI_API_BASE_URL": chat_url + "/v1",
        "OPENAI_API_KEY": "unused",
        "RAG_EMBEDDING_ENGINE": "openai",
        "RAG_OPENAI_API_BASE_URL": embed_url + "/v1",
        "RAG_OPENAI_API_KEY": "unused",
        "RAG_EMBEDDING_MODEL": "minilm",
        "RAG_TEXT_SPLITTER": "character",  # RecursiveCharacterTextSplitter: no tokenizer download
        "CHUNK_SIZE": str(CHUNK_SIZE),
        "CHUNK_OVERLAP": "0",
        "RAG_TOP_K": str(TOP_K),
        "RAG_TEMPLATE": RAG_TEMPLATE,
        # Builtin tools (0.12's native function calling) add ~6,700 prompt tokens of tool specs to
        # every chat, too much for a 0.5B model; greedy answers for a repeatable check.
        "DEFAULT_MODEL_METADATA": json.dumps({"capabilities": {"builtin_tools": False}}),
        "DEFAULT_MODEL_PARAMS": json.dumps({"temperature": 0}),
        # Otherwise the chat model also writes titles, tags, follow-ups and search queries (slow on
        # 2 cores); without query generation the text Open WebUI embeds is the question itself.
        "ENABLE_TITLE_GENERATION": "false",
        "ENABLE_TAGS_GENERATION": "false",
        "ENABLE_FOLLOW_UP_GENERATION": "false",
        "ENABLE_RETRIEVAL_QUERY_GENERATION": "false",
        "ENABLE_AUTOCOMPLETE_GENERATION": "false",
        "OFFLINE_MODE": "true",
        "HF_HUB_OFFLINE": "1",
        "ANONYMIZED_TELEMETRY": "false",  # chromadb's
        "SCARF_NO_ANALYTICS": "true",
        "DO_NOT_TRACK": "true",
    }


def wait_http(url: str, proc: subprocess.Popen, log: str, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}; log {log}:\n{open(log).read()[-3000:]}")
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise RuntimeError(f"{url} not up after {timeout_s:.0f} s; log {log}")


def armserve_server(model: str, args: list[str], log: str):
    """`armserve serve model args` from this checkout on a free loopback port (a peers.Server)."""
    import peers

    port = peers.free_port()
    env = {"PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "armserve.cli", "serve", model, "--host", "127.0.0.1", "--port", str(port), *args]
    spec = peers.ServerSpec(label=f"armserve {os.path.basename(model)}", cmd=cmd, env=env, settings="",
                            weights=model, weight_dtype=None)
    return peers.Server(spec, port, log)


def stop_group(proc: subprocess.Popen) -> None:
    """End `proc` and its children (it leads its own process group), and nothing else."""
    import signal

    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--screenshots", default=None, help="folder for the browser's screenshots (default: the run folder)")
    ap.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    ap.add_argument("--drive", nargs=4, metavar=("URL", "DOC", "SHOTS", "EMBED_URL"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.drive:  # the browser half, run by Open WebUI's venv (playwright)
        drive(*a.drive, chromium=a.chromium)
        return 0

    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import httpx
    import peers
    from bench_embed import minilm_folder
    from peer_models import qwen_gguf
    from transformers import AutoTokenizer

    if not os.path.isfile(a.chromium):
        print("needs Chromium: apt-get install -y chromium", file=sys.stderr)
        return 2
    py = peers.install_open_webui()
    version = subprocess.check_output([py, "-c", "import importlib.metadata as m; print(m.version('open-webui'))"],
                                      text=True).strip()
    minilm = minilm_folder()
    question_tokens = len(AutoTokenizer.from_pretrained(minilm)(QUESTION)["input_ids"])

    run = tempfile.mkdtemp(prefix="armserve-webui-")
    shots = a.screenshots or os.path.join(run, "screenshots")
    os.makedirs(shots, exist_ok=True)
    doc = os.path.join(run, "harbour-notes.txt")
    document(doc)
    servers: list = []
    webui = None
    ok = False
    try:
        print("starting armserve: Qwen2.5-Coder-0.5B-Instruct (chat) and all-MiniLM-L6-v2 (embed) ...", flush=True)
        # Open WebUI >= 0.12 sends its builtin tools with every chat unless they are off (as here):
        # the tool flags are what it needs then, as with vLLM.
        servers.append(armserve_server(qwen_gguf(), [
            "--served-model-name", "qwen", "--max-model-len", "16384", "--kv-cache-space", "0.5",
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes"], os.path.join(run, "armserve-chat.log")))
        servers.append(armserve_server(minilm, ["--served-model-name", "minilm", "--task", "embed",
                                                "--enable-log-requests"], os.path.join(run, "armserve-embed.log")))
        chat_url, embed_url = servers[0].url, servers[1].url

        print(f"starting Open WebUI {version} ...", flush=True)
        env = dict(os.environ)
        env.update(open_webui_env(os.path.join(run, "open-webui-data"), chat_url, embed_url))
        webui_log = os.path.join(run, "open-webui.log")
        webui_url = f"http://127.0.0.1:{peers.free_port()}"
        webui = subprocess.Popen([os.path.join(os.path.dirname(py), "open-webui"), "serve", "--host", "127.0.0.1",
                                  "--port", webui_url.rsplit(":", 1)[1]], env=env, stdout=open(webui_log, "w"),
                                 stderr=subprocess.STDOUT, start_new_session=True)
        wait_http(webui_url + "/health", webui, webui_log, 600)

        print("driving Chromium: upload, ask, wait for the answer ...", flush=True)
        out = subprocess.run([py, os.path.abspath(__file__), "--chromium", a.chromium, "--drive", webui_url, doc,
                              shots, embed_url], capture_output=True, text=True, timeout=3600)
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            print(out.stdout[-3000:], out.stderr[-5000:], sep="\n", file=sys.stderr)
            raise RuntimeError(f"the browser run failed; screenshots in {shots}, Open WebUI's log {webui_log}")
        res = json.loads(line[len("RESULT "):])
        chunks, query = res["chunks"], res["query"]
        refused = re.findall(r'armserve:http_requests_total\{handler="/v1/embeddings",method="POST",'
                             r'status="([45]\d\d)"\} ([1-9][0-9.]*)', httpx.get(embed_url + "/metrics", timeout=30).text)
        checks = {
            f"the answer names {CODENAME}": CODENAME.lower() in res["answer"].lower(),
            f"armserve embedded the document's {len(FILLER) + 1} paragraphs on upload":
                chunks["texts"] == len(FILLER) + 1,
            f"armserve embedded the question ({question_tokens} MiniLM tokens) when it was asked":
                query["texts"] == 1 and query["tokens"] == question_tokens,
            "armserve refused no embedding call": not refused,
        }
        ok = all(checks.values())
        print(f"\nOpen WebUI {version} in Chromium; armserve serving Qwen2.5-Coder-0.5B-Instruct Q4_K_M (chat) "
              f"and all-MiniLM-L6-v2 (embeddings)")
        print(f"question: {QUESTION}")
        print(f"answer:   {res['answer']}")
        print(f"armserve /v1/embeddings: on upload {chunks['calls']} calls, {chunks['texts']} texts, "
              f"{chunks['tokens']} tokens; on the question {query['calls']} call, {query['texts']} text, "
              f"{query['tokens']} tokens")
        for name, passed in checks.items():
            print(f"  [{'ok' if passed else 'FAILED'}] {name}")
        print(f"screenshots: {shots}")
    finally:
        if webui is not None:
            stop_group(webui)
        for s in servers:
            s.stop()
        print(f"run folder (logs, Open WebUI's data): {run}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
