"""Speculative decoding (n-gram): decode tok/s with it on vs off.

    python benchmarks/bench_spec.py                 # the full run (minutes), written to docs/benchmarks.md
    python benchmarks/bench_spec.py --smoke --no-doc  # a few tokens of each, printed only

One process, 1 thread (OMP_NUM_THREADS=1), the offline `LLM`, greedy, two engines per model (with
and without `speculative_config={"method": "ngram", ...}`), both kept loaded, runs alternating.

- batch 1: a code-editing prompt (rename a variable in a function and give the whole function
  back) and a summarise-the-document prompt (a report to summarise, quoting its findings), as
  chat messages, on the bundled SmolLM2 GGUF and Qwen2.5-Coder-0.5B-Instruct GGUF (both kept
  quantized). tok/s = (output tokens - 1) / (last token time - first token time): decode only.
- quantized self-drafting: SmolLM2 dequantized (`quantization="none"`, the default dtype) as the
  target, its w4a8 int4 copy (made at load) drafting, on an open chat prompt, batch 1.
- 8 and 32 concurrent: random 128-token prompts, 64 output tokens each (`ignore_eos`), twice the
  concurrency in prompts, max_num_seqs = the concurrency; tok/s = output tokens / wall time.
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


def alternate(engines: dict, run, rounds: int) -> tuple[dict, float, float]:
    """`run(llm)` `rounds` times per engine, off and on alternating (so drifting load hits both):
    the results per mode and the mean tok/s off and on."""
    res: dict[str, list] = {"off": [], "on": []}
    for r in range(rounds):
        for mode, llm in engines.items():
            res[mode].append(run(llm, r))
    return res, *(sum(x["tok_s"] for x in res[m]) / rounds for m in ("off", "on"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-tokens", type=int, default=160, help="batch-1 output tokens")
    p.add_argument("--rounds", type=int, default=2, help="on/off pairs per measurement")
    p.add_argument("--smoke", action="store_true", help="a few tokens of each: checks the script runs")
    p.add_argument("--skip-qwen", action="store_true")
    p.add_argument("--skip-self-draft", action="store_true")
    p.add_argument("--no-doc", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = p.parse_args()

    import peer_models as pm
    from armserve import LLM

    max_tokens = 16 if args.smoke else args.max_tokens
    rounds = 1 if args.smoke else args.rounds
    models = [("SmolLM2-135M-Instruct Q4_1", pm.smollm2_gguf())]
    if not args.skip_qwen:
        qwen = pm.qwen_gguf(install=False)
        if qwen:
            models.append(("Qwen2.5-Coder-0.5B-Instruct Q4_K_M", qwen))
    rows, conc_rows = [], []
    for name, path in models:
        kw = dict(max_model_len=2048, kv_cache_space=1, enable_prefix_caching=False)
        engines = {"off": LLM(path, **kw), "on": LLM(path, speculative_config=NGRAM, **kw)}
        for llm in engines.values():  # warm-up: step graphs, first-touch memory
            batch1(llm, "Say hello.", 8)
        for kind, prompt in PROMPTS.items():
            res, off, on = alternate(engines, lambda llm, _: batch1(llm, prompt, max_tokens), rounds)
            same = all(a["ids"] == b["ids"] for a, b in zip(res["off"], res["on"]))
            rows.append((name, kind, off, on, res["on"][0]["tokens"], same, acceptance(engines["on"])))
            print(f"{name} / {kind}: off {off:.1f} tok/s, on {on:.1f} tok/s ({on / off:.2f}x), same tokens: {same}",
                  flush=True)
        del engines
        if name.startswith("SmolLM2"):
            for conc in (8, 32):
                kw_c = dict(kw, max_num_seqs=conc)
                engines = {"off": LLM(path, **kw_c), "on": LLM(path, speculative_config=NGRAM, **kw_c)}
                for llm in engines.values():
                    concurrent(llm, conc, 4, seed=99)
                _, off, on = alternate(engines, lambda llm, r: concurrent(llm, 2 * conc if not args.smoke else conc,
                                                                          8 if args.smoke else 64, seed=r), rounds)
                conc_rows.append((name, conc, off, on, acceptance(engines["on"])))
                print(f"{name} / {conc} concurrent: off {off:.1f}, on {on:.1f} ({on / off:.2f}x)", flush=True)
                del engines
    self_rows = []
    if not args.skip_self_draft:
        path = pm.smollm2_gguf()
        kw = dict(max_model_len=2048, kv_cache_space=1, enable_prefix_caching=False, quantization="none")
        draft = {"method": "draft_model", "model": path, "quantization": "w4a8", "num_speculative_tokens": SELF_DRAFT_K}
        engines = {"off": LLM(path, **kw), "on": LLM(path, speculative_config=draft, **kw)}
        for llm in engines.values():
            batch1(llm, "Say hello.", 8)
        res, off, on = alternate(engines, lambda llm, _: batch1(llm, CHAT, max_tokens), rounds)
        same = all(a["ids"] == b["ids"] for a, b in zip(res["off"], res["on"]))
        self_rows.append(("SmolLM2-135M-Instruct, dequantized", "open chat", off, on, res["on"][0]["tokens"], same,
                          acceptance(engines["on"])))
        print(f"self-drafting / open chat: off {off:.1f} tok/s, on {on:.1f} tok/s ({on / off:.2f}x), same: {same}",
              flush=True)
        del engines
    if args.no_doc:
        return 0
    t1 = "\n".join(f"| {n} | {k} | {off:.1f} | {on:.1f} | {on / off:.2f}x | {acc} | {tok} | {'yes' if s else 'no'} |"
                   for n, k, off, on, tok, s, acc in rows)
    t3 = "\n".join(f"| {n} | {k} | {off:.1f} | {on:.1f} | {on / off:.2f}x | {acc} | {tok} | {'yes' if s else 'no'} |"
                   for n, k, off, on, tok, s, acc in self_rows)
    t2 = "\n".join(f"| {n} | {c} | {off:.0f} | {on:.0f} | {on / off:.2f}x | {acc} |" for n, c, off, on, acc in conc_rows)
    body = f"""## Speculative decoding: n-gram drafts on vs off (issue 31)

Machine: {machine_description()}. armserve rev `{git_revision()}`, 1 thread, offline `LLM`, greedy,
`speculative_config={NGRAM}`; GGUF weights kept quantized. Load average at the end: {load_average():.2f}.

Batch 1 (decode tok/s: output tokens after the first over the time between first and last token; {rounds} runs
each, alternating; `same tokens`: the outputs with and without speculation are identical):

| model | prompt | off tok/s | on tok/s | on / off | draft acceptance | output tokens | same tokens |
|---|---|---|---|---|---|---|---|
{t1}

Quantized self-drafting (batch 1, decode tok/s; target SmolLM2 dequantized to the default dtype, draft its w4a8
int4 copy made at load, `num_speculative_tokens` {SELF_DRAFT_K}):

| target | prompt | off tok/s | on tok/s | on / off | draft acceptance | output tokens | same tokens |
|---|---|---|---|---|---|---|---|
{t3}

Concurrent random 128-token prompts, 64 output tokens each (`ignore_eos`), twice the concurrency in prompts
(output tok/s over the whole run):

| model | concurrent | off tok/s | on tok/s | on / off | draft acceptance |
|---|---|---|---|---|---|
{t2}

Reproduce: `python benchmarks/bench_spec.py`"""
    update_section("spec_decode", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
