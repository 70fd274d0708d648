"""Speculative decoding (n-gram, suffix, draft models): decode tok/s with it on vs off.

    python benchmarks/bench_spec.py                 # the full run (minutes), written to docs/benchmarks.md
    python benchmarks/bench_spec.py --smoke --no-doc  # a few tokens of each, printed only

One process, 1 thread (OMP_NUM_THREADS=1), the offline `LLM`, greedy, three engines per model
(without speculation, `speculative_config` method "ngram" and method "suffix"), all kept loaded,
runs alternating.

- batch 1: a code-editing prompt (rename a variable in a function and give the whole function
  back) and a summarise-the-document prompt (a report to summarise, quoting its findings), as
  chat messages, on the bundled SmolLM2 GGUF and Qwen2.5-Coder-0.5B-Instruct GGUF (both kept
  quantized). tok/s = (output tokens - 1) / (last token time - first token time): decode only.
- agent loop: the same task asked again with another name each time, one request after another
  (what an agent's repeated tool calls look like): its answers repeat earlier answers, not its
  prompt. Suffix decoding's cache of earlier outputs drafts them; mean over all but the first.
- quantized self-drafting: SmolLM2 dequantized (`quantization="none"`, the default dtype) and the
  Qwen2.5-Coder GGUF dequantized into an HF folder (peer_models.qwen_hf) as targets, each drafted for
  by its w4a8 int4 copy (made at load), on an open chat prompt, batch 1.
- 8 and 32 concurrent: random 128-token prompts, 64 output tokens each (`ignore_eos`), twice the
  concurrency in prompts, max_num_seqs = the concurrency; tok/s = output tokens / wall time.
- llama-server, when built (benchmarks/peers.py builds it; this script does not): both as OpenAI
  servers (`armserve serve`), the SmolLM2 GGUF and the same prompts, 1 thread, 1 / 4 / 8 streams:
  without drafting, its lookup decoding (`--spec-type ngram-simple`) against armserve's ngram, and
  the BF16 SmolLM2 GGUF drafted for by the Q4_1 one (`-md`, armserve draft_model)
  (`--skip-llama-server`).
The section "spec_decode" of docs/benchmarks.md gets the table.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from report import git_revision, load_average, machine_description, update_section  # noqa: E402

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
SUFFIX = {"method": "suffix"}
METHODS = {"ngram": NGRAM, "suffix": SUFFIX}

CODE = '''def summarize_orders(orders, tax_rate):
    """Totals per customer, with tax, for the orders that were paid."""
    totals = {}
    for order in orders:
        if not order["paid"]:
            continue
        customer = order["customer"]
        amount = order["quantity"] * order["unit_price"]
        amount = amount * (1 + tax_rate)
        if customer not in totals:
            totals[customer] = 0.0
        totals[customer] += amount
    result = []
    for customer, total in sorted(totals.items()):
        result.append({"customer": customer, "total": round(total, 2)})
    return result
'''

DOCUMENT = (
    "Quarterly report, northern region. Sales rose by 12 percent compared with the previous quarter, "
    "driven by the new line of garden tools and by the reopening of the two stores in Leeds. Costs rose "
    "by 4 percent, mostly because of higher shipping prices. The warehouse in York reached full capacity "
    "in August, and the team recommends renting a second site before the winter season. Customer "
    "complaints fell by a third after the new returns policy was introduced in July. Staff turnover "
    "remained at 9 percent. The region plans to hire twelve more people for the holiday period and to "
    "trial same-day delivery in Sheffield from November. Risks: a supplier of lawn mowers has warned of "
    "delays of up to six weeks, and energy prices may raise store running costs by 2 percent."
)

SELF_DRAFT_K = 3
CHAT = "Tell me about the history of the bicycle, from the first designs to today."

AGENT_TASK = ("Write a Python function named `{}` that returns True when a string is a palindrome, "
              "ignoring case, spaces and punctuation. Include a docstring.")
AGENT_NAMES = ["is_palindrome", "check_palindrome", "palindrome_ok", "looks_symmetric", "reads_same", "mirror_text"]

PROMPTS = {
    "code editing": "Rename the variable `totals` to `per_customer` in this function and give back the "
                    "whole function, unchanged otherwise:\n\n```python\n" + CODE + "```",
    "summarise the document": "Summarise this report in a few sentences, keeping its own wording and "
                              "numbers:\n\n" + DOCUMENT,
}


def decode_tok_s(out) -> tuple[float, int]:
    """(decode tok/s, output tokens) of one finished request."""
    m, n = out.metrics, len(out.outputs[0].token_ids)
    span = (m.last_token_time or 0) - (m.first_token_time or 0)
    return ((n - 1) / span if span > 0 and n > 1 else 0.0), n


def batch1(llm, prompt: str, max_tokens: int) -> dict:
    from armserve import SamplingParams

    out = llm.chat([{"role": "user", "content": prompt}], SamplingParams(temperature=0, max_tokens=max_tokens),
                   use_tqdm=False)[0]
    tok_s, n = decode_tok_s(out)
    return {"tok_s": tok_s, "tokens": n, "ids": out.outputs[0].token_ids}


def concurrent(llm, n_prompts: int, out_tokens: int, seed: int) -> dict:
    from armserve import SamplingParams

    rng = random.Random(seed)
    vocab = llm.llm_engine.backend.vocab_size
    prompts = [{"prompt_token_ids": [rng.randrange(100, vocab - 100) for _ in range(128)]} for _ in range(n_prompts)]
    t = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=out_tokens, ignore_eos=True),
                        use_tqdm=False)
    took = time.perf_counter() - t
    return {"tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / took}


def acceptance(llm) -> str:
    st = llm.llm_engine.backend.scheduler.spec_stats
    return f"{100 * st.acceptance_rate:.0f}%" if st is not None and st.num_draft_tokens else "-"


def alternate(engines: dict, run, rounds: int, skip: int = 0) -> tuple[dict, dict]:
    """`run(llm, r)` `rounds` times per engine, the engines alternating (so drifting load hits
    all) and each round starting one engine later (so none always runs first, after the idle
    start of a round): the results per mode and each mode's mean tok/s (over the rounds after `skip`)."""
    res: dict[str, list] = {m: [] for m in engines}
    modes = list(engines)
    for r in range(rounds):
        for mode in modes[r % len(modes):] + modes[:r % len(modes)]:
            res[mode].append(run(engines[mode], r))
    return res, {m: sum(x["tok_s"] for x in v[skip:]) / (rounds - skip) for m, v in res.items()}


def llama_server_exe() -> str | None:
    """llama-server if benchmarks/peers.py has built it (building it takes ~10 min: not here)."""
    import peers

    exe = os.path.join(peers.PEERS_DIR, "llama.cpp", "build", "bin", "llama-server")
    return exe if os.path.isfile(exe) else None


STREAMS = (1, 4, 8)
# llama-server's lookup decoding set like armserve's ngram: 3-token lookup, 4 tokens drafted
LLAMA_NGRAM = ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m", "4",
               "--spec-draft-n-max", "4"]


def server_specs(mode: str, target: str, draft: str | None, slots: int):
    """(armserve's, llama-server's) ServerSpec for one drafting mode on `target` (a GGUF): 1 thread
    each, `slots` parallel sequences; `draft`: the draft GGUF of mode "draft"."""
    import json

    import peers

    spec = {"none": None, "lookup": NGRAM,
            "draft": {"method": "draft_model", "model": draft, "num_speculative_tokens": 4}}[mode]
    pa, pl = peers.free_port(), peers.free_port()
    ours = [sys.executable, "-m", "armserve.cli", "serve", target, "--host", "127.0.0.1", "--port", str(pa),
            "--max-model-len", "2048", "--kv-cache-space", "1", "--max-num-seqs", str(slots), "--served-model-name",
            "m", "--disable-log-stats", "--disable-access-log", "--uvicorn-log-level", "warning"]
    if spec is not None:
        ours += ["--speculative-config", json.dumps(spec)]
    theirs = [llama_server_exe(), "-m", target, "-t", "1", "-tb", "1", "-np", str(slots), "-c", str(slots * 2048),
              "--host", "127.0.0.1", "--port", str(pl), "--alias", "m", "--no-repack"]
    theirs += {"none": [], "lookup": LLAMA_NGRAM,
               "draft": ["-md", str(draft), "-td", "1", "-tbd", "1", "--spec-draft-n-max", "4"]}[mode]
    env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": os.path.dirname(HERE)}
    return ((peers.ServerSpec(f"armserve {mode}", ours, env, "", target, None), pa),
            (peers.ServerSpec(f"llama-server {mode}", theirs, env, "", target, None), pl))


def http_streams(url: str, prompt: str, streams: int, max_tokens: int) -> dict:
    """`streams` copies of the chat prompt at once through /v1/chat/completions, greedy: output
    tok/s over the wall time of all (prefill included, the same clock for both servers)."""
    import concurrent.futures

    import httpx

    body = {"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0}

    def one(_):
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=1800)
        r.raise_for_status()
        return r.json()

    t = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(streams) as ex:
        outs = list(ex.map(one, range(streams)))
    took = time.perf_counter() - t
    return {"tok_s": sum(o["usage"]["completion_tokens"] for o in outs) / took,
            "tokens": outs[0]["usage"]["completion_tokens"]}


def versus_llama_server(gguf: str, draft_pair: tuple[str, str] | None, max_tokens: int, rounds: int,
                        streams: tuple[int, ...] = STREAMS) -> list[tuple]:
    """Rows (prompt, streams, drafting, armserve tok/s, llama-server tok/s, load average): both
    servers over HTTP with the same requests, runs alternating; drafting `none` and `lookup` on
    `gguf`, `draft` on draft_pair = (target GGUF, draft GGUF). [] without llama-server."""
    import peers

    if llama_server_exe() is None:
        print("llama-server not built (benchmarks/peers.py install_llama_server()): no comparison", flush=True)
        return []
    rows = []
    cases = [("none", gguf, None), ("lookup", gguf, None)] + ([("draft", *draft_pair)] if draft_pair else [])
    for mode, target, draft in cases:
        servers = []
        try:
            for spec, port in server_specs(mode, target, draft, max(streams)):
                servers.append(peers.Server(spec, port, os.path.join("/tmp", f"bench-spec-{port}.log")))
            ours, theirs = servers
            for s in servers:  # warm-up
                http_streams(s.url, "Say hello.", 1, 8)
            for kind, prompt in PROMPTS.items():
                for n in streams:
                    a = b = 0.0
                    for _ in range(rounds):
                        a += http_streams(ours.url, prompt, n, max_tokens)["tok_s"] / rounds
                        b += http_streams(theirs.url, prompt, n, max_tokens)["tok_s"] / rounds
                    rows.append((kind, n, mode, a, b, load_average()))
                    print(f"vs llama-server / {kind} / {n} streams / {mode}: armserve {a:.1f}, llama-server {b:.1f} "
                          f"tok/s ({a / max(b, 1e-9):.2f}x)", flush=True)
        finally:
            for s in servers:
                s.stop()
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-tokens", type=int, default=160, help="batch-1 output tokens (open chat, agent loop, HTTP)")
    p.add_argument("--edit-max-tokens", type=int, default=512,
                   help="output cap of the code-editing and summarising prompts: room to finish the answer "
                        "(both models end it by themselves; a cap cuts a code edit before its copied code)")
    p.add_argument("--rounds", type=int, default=2, help="on/off pairs per measurement")
    p.add_argument("--smoke", action="store_true", help="a few tokens of each: checks the script runs")
    p.add_argument("--skip-qwen", action="store_true")
    p.add_argument("--skip-self-draft", action="store_true")
    p.add_argument("--skip-llama-server", action="store_true")
    p.add_argument("--skip-batch1", action="store_true", help="no batch-1 prompts")
    p.add_argument("--skip-concurrent", action="store_true", help="no 8 / 32 concurrent runs")
    p.add_argument("--no-doc", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = p.parse_args()

    import peer_models as pm
    from armserve import LLM

    max_tokens = 16 if args.smoke else args.max_tokens
    edit_max_tokens = 16 if args.smoke else args.edit_max_tokens
    rounds = 1 if args.smoke else args.rounds
    models = [("SmolLM2-135M-Instruct Q4_1", pm.smollm2_gguf())]
    if not args.skip_qwen:
        qwen = pm.qwen_gguf(install=False)
        if qwen:
            models.append(("Qwen2.5-Coder-0.5B-Instruct Q4_K_M", qwen))
    rows, conc_rows = [], []
    for name, path in models if not args.skip_batch1 else []:
        kw = dict(max_model_len=2048, kv_cache_space=1, enable_prefix_caching=False)
        engines = {"off": LLM(path, **kw), **{m: LLM(path, speculative_config=c, **kw) for m, c in METHODS.items()}}
        for llm in engines.values():  # warm-up: step graphs (verify ones too, as a server's start-up), first-touch memory
            llm.llm_engine.backend.warm_up()
            batch1(llm, "Say hello.", 8)
        agent = len(AGENT_NAMES) if not args.smoke else 2
        work = [(kind, lambda llm, _, prompt=prompt: batch1(llm, prompt, edit_max_tokens), rounds, 0)
                for kind, prompt in PROMPTS.items()]
        work.append(("agent loop", lambda llm, r: batch1(llm, AGENT_TASK.format(AGENT_NAMES[r]), max_tokens), agent, 1))
        for kind, run, n, skip in work:
            res, tok_s = alternate(engines, run, n, skip)
            for m in METHODS:
                same = all(a["ids"] == b["ids"] for a, b in zip(res["off"], res[m]))
                rows.append((name, kind, m, tok_s["off"], tok_s[m], res[m][-1]["tokens"], same,
                             acceptance(engines[m])))
                print(f"{name} / {kind} / {m}: off {tok_s['off']:.1f} tok/s, on {tok_s[m]:.1f} tok/s "
                      f"({tok_s[m] / tok_s['off']:.2f}x), same tokens: {same}", flush=True)
        del engines
    for name, path in models[:1] if not args.skip_concurrent else []:  # (SmolLM2 only)
        kw = dict(max_model_len=2048, kv_cache_space=1, enable_prefix_caching=False)
        for conc in (8, 32):
            kw_c = dict(kw, max_num_seqs=conc)
            # "off again": a second engine without speculation, the A/A control that shows what the
            # ratios vary by when nothing differs
            engines = {"off": LLM(path, **kw_c), "off again": LLM(path, **kw_c),
                       **{m: LLM(path, speculative_config=c, **kw_c) for m, c in METHODS.items()}}
            for llm in engines.values():
                concurrent(llm, conc, 4, seed=99)
            _, tok_s = alternate(engines, lambda llm, r: concurrent(llm, 2 * conc if not args.smoke else conc,
                                                                    8 if args.smoke else 64, seed=r), rounds)
            for m in ["off again", *METHODS]:
                drafts = engines[m].llm_engine.backend.scheduler.spec_stats
                conc_rows.append((name, conc, m, tok_s["off"], tok_s[m], acceptance(engines[m]),
                                  drafts.num_drafts if drafts is not None else 0))
                print(f"{name} / {conc} concurrent / {m}: off {tok_s['off']:.1f}, on {tok_s[m]:.1f} "
                      f"({tok_s[m] / tok_s['off']:.2f}x), verifications {conc_rows[-1][-1]}", flush=True)
            del engines
    self_rows = []
    if not args.skip_self_draft:
        # (target label, checkpoint, engine keywords): the dequantized SmolLM2 GGUF, and the Qwen2.5-Coder
        # GGUF dequantized by transformers into an HF folder (benchmarks/peer_models.py, made once)
        targets = [("SmolLM2-135M-Instruct, dequantized", pm.smollm2_gguf(), {"quantization": "none"})]
        if not args.skip_qwen and pm.qwen_gguf(install=False):
            targets.append(("Qwen2.5-Coder-0.5B-Instruct, dequantized HF folder", pm.qwen_hf(), {}))
        for label, path, extra in targets:
            kw = dict(max_model_len=2048, kv_cache_space=1, enable_prefix_caching=False, **extra)
            draft = {"method": "draft_model", "model": path, "quantization": "w4a8",
                     "num_speculative_tokens": SELF_DRAFT_K}
            engines = {"off": LLM(path, **kw), "on": LLM(path, speculative_config=draft, **kw)}
            for llm in engines.values():
                batch1(llm, "Say hello.", 8)
            res, tok_s = alternate(engines, lambda llm, _: batch1(llm, CHAT, max_tokens), rounds)
            off, on = tok_s["off"], tok_s["on"]
            same = all(a["ids"] == b["ids"] for a, b in zip(res["off"], res["on"]))
            dtype = str(engines["off"].llm_engine.backend.dtype).replace("torch.", "")
            self_rows.append((f"{label} ({dtype})", "open chat", off, on, res["on"][0]["tokens"], same,
                              acceptance(engines["on"])))
            print(f"self-drafting / {label} / open chat: off {off:.1f} tok/s, on {on:.1f} tok/s ({on / off:.2f}x), "
                  f"same: {same}", flush=True)
            del engines
    vs_llama = [] if args.skip_llama_server else versus_llama_server(
        pm.smollm2_gguf(), (pm.smollm2_bf16_gguf(), pm.smollm2_gguf()), max_tokens, rounds,
        (1, 4) if args.smoke else STREAMS)
    if args.no_doc:
        return 0
    t1 = "\n".join(f"| {n} | {k} | {m} | {off:.1f} | {on:.1f} | {on / off:.2f}x | {acc} | {tok} | "
                   f"{'yes' if s else 'no'} |" for n, k, m, off, on, tok, s, acc in rows)
    t3 = "\n".join(f"| {n} | {k} | {off:.1f} | {on:.1f} | {on / off:.2f}x | {acc} | {tok} | {'yes' if s else 'no'} |"
                   for n, k, off, on, tok, s, acc in self_rows)
    t2 = "\n".join(f"| {n} | {c} | {m} | {off:.0f} | {on:.0f} | {on / off:.2f}x | {acc} | {v} |"
                   for n, c, m, off, on, acc, v in conc_rows)
    t4 = "\n".join(f"| {k} | {n} | {m} | {a:.1f} | {b:.1f} | {a / max(b, 1e-9):.2f}x | {ld:.1f} |"
                   for k, n, m, a, b, ld in vs_llama)
    t4 = f"""
Against llama-server, both as OpenAI servers on the same GGUF, 1 thread each (`-t 1 -tb 1`), {max(STREAMS)}
parallel slots / `--max-num-seqs {max(STREAMS)}`, the same chat requests (greedy, `max_tokens` {max_tokens}) sent
1, 4 or 8 at a time, runs alternating; output tok/s over the wall time (prefill included). Drafting
`none`: neither drafts; `lookup`: armserve `ngram` as above against llama-server `{' '.join(LLAMA_NGRAM)}`,
on the SmolLM2 Q4_1 GGUF; `draft`: the SmolLM2 BF16 GGUF (`peer_models.smollm2_bf16_gguf`) as the target
with the Q4_1 GGUF drafting 4 tokens (armserve `draft_model`, llama-server `-md`). `load`: the load average
after the row:

| prompt | streams | drafting | armserve tok/s | llama-server tok/s | armserve / llama-server | load |
|---|---|---|---|---|---|---|
{t4}
""" if vs_llama else ""
    body = f"""## Speculative decoding: n-gram and suffix drafts on vs off (issue 31)

Machine: {machine_description()}. armserve rev `{git_revision()}`, 1 thread, offline `LLM`, greedy,
`speculative_config` {NGRAM} (ngram) or {SUFFIX} (suffix, vLLM's defaults); GGUF weights kept quantized.
Load average at the end: {load_average():.2f}.

Batch 1 (decode tok/s: output tokens after the first over the time between first and last token; {rounds} runs
each, alternating; code editing and summarising: up to {edit_max_tokens} tokens, so that the answer ends by
itself (a code edit copies its function after a sentence or two of prose); agent loop: {len(AGENT_NAMES) - 1} requests after a first one, each the same task with
another function name; `same tokens`: the outputs with and without speculation are identical):

| model | prompt | method | off tok/s | on tok/s | on / off | draft acceptance | output tokens | same tokens |
|---|---|---|---|---|---|---|---|---|
{t1}

Quantized self-drafting (batch 1, decode tok/s; the target dequantized, in the default dtype (float32 on a
CPU without native bfloat16), drafted for by its own w4a8 int4 copy made at load, `num_speculative_tokens`
{SELF_DRAFT_K}):

| target | prompt | off tok/s | on tok/s | on / off | draft acceptance | output tokens | same tokens |
|---|---|---|---|---|---|---|---|
{t3}

Concurrent random 128-token prompts, 64 output tokens each (`ignore_eos`), twice the concurrency in prompts
(output tok/s over the whole run):

| model | concurrent | method | off tok/s | on tok/s | on / off | draft acceptance | requests' verify steps |
|---|---|---|---|---|---|---|---|
{t2}

("off again" is a second engine without speculation: its ratio is what two identical engines differ by.)
{t4}
Reproduce: `python benchmarks/bench_spec.py`"""
    update_section("spec_decode", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
