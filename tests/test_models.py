"""Greedy output and per-step log-probabilities match Hugging Face transformers."""

from __future__ import annotations

import math

import pytest
import torch

from armserve import LLM, SamplingParams
from conftest import FORCED_RERUN, hf_model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a land far away, there lived a dragon who",
]
NUM_TOKENS = 12 if FORCED_RERUN else 32
TOP = 5


def hf_greedy(folder: str, prompt_ids: list[int], num_tokens: int):
    """transformers' greedy tokens and the log-softmax of its logits at each step."""
    model = hf_model(folder)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=num_tokens,
            min_new_tokens=num_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    logprobs = [torch.log_softmax(step[0].float(), dim=-1) for step in out.logits]
    return tokens, logprobs


def assert_matches_hf(folder_for_hf: str, llm: LLM, prompt: str, atol: float) -> None:
    # min_tokens suppresses EOS like transformers' min_new_tokens does
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS, logprobs=TOP)
    ours = llm.generate([prompt], params, use_tqdm=False)[0]
    ref_tokens, ref_lp = hf_greedy(folder_for_hf, ours.prompt_token_ids, NUM_TOKENS)
    got = ours.outputs[0].token_ids
    assert got == ref_tokens, f"greedy tokens differ from transformers for {prompt!r}"
    assert len(ours.outputs[0].logprobs) == NUM_TOKENS
    worst = 0.0
    for step, (pos, ref) in enumerate(zip(ours.outputs[0].logprobs, ref_lp)):
        assert len(pos) >= TOP
        for tok, lp in pos.items():
            worst = max(worst, abs(lp.logprob - ref[tok].item()))
            # rank is 1 + the number of tokens transformers finds strictly more likely
            assert lp.rank == 1 + int((ref > ref[tok] + 1e-4).sum()) or abs(lp.logprob - ref[tok].item()) < 1e-3
    assert worst < atol, f"log-probs differ from transformers by {worst:.2e} (tolerance {atol})"


@pytest.mark.parametrize("name", ["llama", "llama3-rope-tied", "mistral", "qwen2", "qwen2-yarn", "qwen3", "gemma3",
                                  "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3"])
def test_tiny_architectures_match_transformers(tiny_checkpoints, name):
    folder = tiny_checkpoints[name]
    llm = LLM(folder, dtype="float32", kv_cache_space=0.05, max_model_len=512, block_size=16)
    for prompt in PROMPTS:
        assert_matches_hf(folder, llm, prompt, atol=1e-4)


def test_rope_tables_end_at_max_model_len_and_its_last_position_matches_transformers(tiny_llama):
    """The rotary tables keep max_model_len (+1) rows, not max_position_embeddings' (512 here; 131k
    for Llama 3.x): a sequence that fills max_model_len to its last position gives transformers'
    greedy tokens, and the kept rows are the full table's."""
    from armserve.layers.rotary_embedding import RotaryEmbedding, _cos_sin, rope_parameters

    llm = LLM(tiny_llama, dtype="float32", kv_cache_space=0.02, max_model_len=48)
    model = llm.llm_engine.model
    ropes = [m for m in model.modules() if isinstance(m, RotaryEmbedding)]
    assert ropes and all(m.cos_sin.shape[0] == 49 for m in ropes)
    full = _cos_sin(ropes[0].rotary_dim, 512, rope_parameters(hf_model(tiny_llama).config))
    assert torch.equal(ropes[0].cos_sin, full[:49])
    prompt = llm.get_tokenizer().encode("the cat ran over the blue sea and")
    steps = 48 - len(prompt)
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=steps,
                                                                       min_tokens=steps), use_tqdm=False)[0]
    assert len(prompt) + len(out.outputs[0].token_ids) == 48
    assert out.outputs[0].token_ids == hf_greedy(tiny_llama, prompt, steps)[0]


def test_mistral_sliding_window_is_used(tiny_checkpoints):
    """The window (8) is shorter than the sequence, so ignoring it would change the logits."""
    folder = tiny_checkpoints["mistral"]
    llm = LLM(folder, dtype="float32", kv_cache_space=0.05)
    layers = llm.llm_engine.model.attention_layers()
    assert all(a.sliding_window == 8 for a in layers)


def test_smollm2_gguf_matches_transformers(smollm2_gguf, smollm2_hf_reference):
    # quantization="none": dequantize the GGUF's Q4_1/Q8_0 blocks to float32, as transformers does
    llm = LLM(smollm2_gguf, dtype="float32", kv_cache_space=0.2, max_model_len=1024, quantization="none")
    for prompt in PROMPTS[:2]:
        assert_matches_hf(smollm2_hf_reference, llm, prompt, atol=2e-3)
    # The chat template from the GGUF header gives a sensible answer.
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
        SamplingParams(temperature=0.0, max_tokens=8),
        use_tqdm=False,
    )[0]
    assert "Paris" in out.outputs[0].text


def test_gguf_load_prints_no_warnings(smollm2_gguf):
    """Loading a GGUF shows armserve's own log lines only: no transformers warning (a deprecated
    config attribute read on every GGUF load used to print one), in a fresh process since
    transformers prints each warning once per process."""
    import subprocess
    import sys

    code = ("from armserve import LLM; import sys; "
            "LLM(sys.argv[1], kv_cache_space=0.05, max_model_len=128)")
    r = subprocess.run([sys.executable, "-c", code, smollm2_gguf], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    noise = [line for line in (r.stdout + r.stderr).splitlines()
             if line.strip() and "armserve" not in line and not line.startswith("INFO")]
    assert not noise, noise


def test_gemma3_gguf_matches_transformers(gemma3_gguf, gemma3_hf_reference):
    """The real Gemma-3-270M GGUF (no chat template: a base model), dequantized, against
    transformers on the same file: its norms are stored as 1 + w, its q/k norms and local/global
    layers all in play."""
    llm = LLM(gemma3_gguf, dtype="float32", kv_cache_space=0.2, max_model_len=1024, quantization="none")
    for prompt in PROMPTS[:2]:
        assert_matches_hf(gemma3_hf_reference, llm, prompt, atol=2e-3)


def test_gemma3_gguf_quantized_perplexity(gemma3_gguf, gemma3_hf_reference):
    """Kept quantized (w4a8 / w8a8 from Q4_K / Q6_K blocks), Gemma 3's perplexity on a text stays
    within 3% of transformers' on the same file dequantized."""
    from armserve.evaluate import perplexity

    text = (
        "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
        "combined movable metal type, oil-based ink and a wooden press adapted from those used to make "
        "wine. Books, once copied by hand over months, could now be produced by the hundreds in weeks. "
        "Within fifty years presses were working in more than two hundred European cities, and the "
        "spread of printed pamphlets changed how news, science and religious ideas travelled."
    )
    llm = LLM(gemma3_gguf, kv_cache_space=0.2, max_model_len=1024)
    ids = llm.get_tokenizer()(text)["input_ids"][:40 if FORCED_RERUN else None]
    ours = perplexity(llm, ids, window=len(ids))
    ref_model = hf_model(gemma3_hf_reference)  # the test above's, kept: one load per process
    with torch.no_grad():
        ref = math.exp(ref_model(torch.tensor([ids]), labels=torch.tensor([ids])).loss.item())
    assert abs(ours / ref - 1) < 0.03, (ours, ref)


def test_bfloat16_close_to_float32(tiny_llama):
    f32 = LLM(tiny_llama, dtype="float32", kv_cache_space=0.05)
    bf16 = LLM(tiny_llama, dtype="bfloat16", kv_cache_space=0.05)
    assert bf16.llm_engine.kv.num_blocks > f32.llm_engine.kv.num_blocks  # half the bytes per block
    p = SamplingParams(temperature=0.0, max_tokens=1, logprobs=3)
    a = f32.generate(PROMPTS, p, use_tqdm=False)
    b = bf16.generate(PROMPTS, p, use_tqdm=False)
    for x, y in zip(a, b):
        tok = x.outputs[0].token_ids[0]
        lp_b = y.outputs[0].logprobs[0].get(tok)
        assert lp_b is not None and math.isclose(lp_b.logprob, x.outputs[0].logprobs[0][tok].logprob, abs_tol=0.1)


def test_gguf_file_is_parsed_once_per_load(smollm2_gguf, monkeypatch):
    """Config, tokenizer and weights share one parse of the GGUF header (a 150k-entry vocabulary
    takes seconds to parse), and nothing of it stays patched or cached after the load."""
    import gguf
    from gguf.gguf_reader import GGUFReader

    from armserve.model_loader import gguf as gguf_loader

    parses = []
    original_init = GGUFReader.__init__

    def counting_init(self, path, *args, **kwargs):
        parses.append(path)
        original_init(self, path, *args, **kwargs)

    monkeypatch.setattr(GGUFReader, "__init__", counting_init)
    # transformers' conversion of the whole header to Python values (AutoConfig and AutoTokenizer
    # each ask for it): once per load too
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    headers = []
    original_header = hf_gguf.load_gguf_checkpoint

    def counting_header(path, *args, **kwargs):
        headers.append(path)
        return original_header(path, *args, **kwargs)

    monkeypatch.setattr(hf_gguf, "load_gguf_checkpoint", counting_header)
    package_reader = gguf.GGUFReader
    llm = LLM(smollm2_gguf, dtype="float32", kv_cache_space=0.05, max_model_len=128)
    assert len(parses) == 1 and len(headers) == 1, (parses, headers)
    assert gguf.GGUFReader is package_reader and hf_gguf.load_gguf_checkpoint is counting_header
    assert gguf_loader._READER is None and gguf_loader._HEADER is None
    assert llm.get_tokenizer().vocab_size == 49152
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
