"""LoRA adapters (armserve/lora/, layers/lora.py) against PEFT on tiny random Llama and Qwen2 bases:
greedy tokens identical in float32 for several adapters and the base mixed in one batch, logprobs
close; bf16; a w4a8-quantized base; prefix-cache isolation; the LRU; bad folders named."""

from __future__ import annotations

import functools
import json
import os
import shutil

import pytest
import torch

from conftest import CACHE, TINY, make_tiny_checkpoint

from armserve import LLM, SamplingParams
from armserve.lora import LoRAError, LoRARequest

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time there"]
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base: str, out: str, seed: int, r: int = 8, targets=ALL_TARGETS, **cfg) -> str:
    """A PEFT adapter of `base` with random A and B (PEFT starts B at zero: no effect to test)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out = f"{out}-{seed}-{r}-{'_'.join(targets)}-{'_'.join(f'{k}{v}' for k, v in sorted(cfg.items()))}"
    if os.path.isfile(os.path.join(out, "adapter_model.safetensors")):
        return out
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(seed)
    peft = get_peft_model(model, LoraConfig(r=r, lora_alpha=cfg.pop("lora_alpha", 2 * r), target_modules=targets,
                                            init_lora_weights=False, **cfg))
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.15)
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    peft.save_pretrained(tmp)
    os.replace(tmp, out)
    return out


@functools.lru_cache(maxsize=8)
def peft_model(base: str, adapter: str | None, merged: bool = False):
    """transformers' float32 base with PEFT's adapter (unmerged LoRA layers, or merged into the weights)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
        if merged:
            model = model.merge_and_unload()
    return model


@functools.lru_cache(maxsize=4)
def hf_tokenizer(base: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(base)


def peft_logprobs(base: str, adapter: str | None, prompt: str, tokens: list[int], merged: bool = False
                  ) -> torch.Tensor:
    """PEFT's log-probabilities [len(tokens), vocab] of the position before each of `tokens` after
    `prompt`, in one forward: `tokens` are PEFT's greedy ones exactly when each is its row's argmax."""
    ids = hf_tokenizer(base)(prompt, return_tensors="pt").input_ids
    ids = torch.cat([ids, torch.tensor([tokens[:-1]])], dim=1)
    with torch.no_grad():
        logits = peft_model(base, adapter, merged)(ids).logits[0, -len(tokens):].float()
    return torch.log_softmax(logits, -1)


def assert_peft_greedy(base: str, adapter: str | None, prompt: str, tokens: list[int], logprobs=None,
                       merged: bool = False) -> None:
    """`tokens` are PEFT's greedy continuation of `prompt` (a near-tie may go either way) and
    `logprobs` (ours, of each token) are within 2e-3 of PEFT's."""
    ref = peft_logprobs(base, adapter, prompt, tokens, merged)
    for i, t in enumerate(tokens):
        assert float(ref[i].max() - ref[i, t]) < 1e-4, (adapter, prompt, i, int(ref[i].argmax()), t)
    if logprobs is not None:
        assert logprobs == pytest.approx([float(ref[i, t]) for i, t in enumerate(tokens)], abs=2e-3)


@pytest.fixture(scope="module")
def bases(tokenizer_dir) -> dict[str, str]:
    return {
        "llama": make_tiny_checkpoint(os.path.join(CACHE, "tiny-llama"), "LlamaForCausalLM", tokenizer_dir),
        "qwen2": make_tiny_checkpoint(os.path.join(CACHE, "tiny-qwen2"), "Qwen2ForCausalLM", tokenizer_dir),
    }


def adapters_of(base: str, family: str) -> list[str]:
    root = os.path.join(CACHE, f"lora-{family}")
    return [make_adapter(base, root, 1, r=8),
            make_adapter(base, root, 2, r=4, targets=["q_proj", "v_proj"], use_rslora=True),
            make_adapter(base, root, 3, r=16, targets=["gate_proj", "down_proj", "o_proj"])]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_mixed_batch_matches_peft(bases, family):
    """Three adapters (ranks 8/4/16, rsLoRA, partial targets) and the base in ONE batch: each
    prompt's greedy tokens equal PEFT's unmerged model's, logprobs close; merged PEFT agrees."""
    base = bases[family]
    adapters = adapters_of(base, family)
    n = 6
    llm = LLM(base, dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=16, kv_cache_space=0.02)
    sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=0)
    loras = [None if a is None else LoRARequest(f"a{i}", i, a) for i, a in enumerate([None] + adapters)
             for _ in PROMPTS]
    outs = llm.generate(PROMPTS * (len(adapters) + 1), sp, use_tqdm=False, lora_request=loras)
    for out, lora in zip(outs, loras):
        got = out.outputs[0]
        assert_peft_greedy(base, lora and lora.lora_path, out.prompt, list(got.token_ids),
                           [next(iter(d.values())).logprob for d in got.logprobs])
    # the adapters change the output at all (else this test could not fail)
    assert len({tuple(o.outputs[0].token_ids) for o in outs[::len(PROMPTS)]}) > 1
    assert_peft_greedy(base, adapters[0], PROMPTS[0], list(outs[len(PROMPTS)].outputs[0].token_ids), merged=True)


def first_token_logprobs(llm: LLM, prompt: str, lora=None) -> dict[int, float]:
    sp = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
    out = llm.generate([prompt], sp, use_tqdm=False, lora_request=lora)[0].outputs[0]
    return {t: lp.logprob for t, lp in out.logprobs[0].items()}


def peft_first_logprobs(base: str, adapter: str, prompt: str) -> torch.Tensor:
    ids = hf_tokenizer(base)(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        return torch.log_softmax(peft_model(base, adapter)(ids).logits[0, -1].float(), -1)


def test_bf16_close_to_peft(bases):
    """bf16 base and adapter (the deltas rounded to bf16 once) within tolerance of PEFT in float32."""
    base = bases["llama"]
    adapter = adapters_of(base, "llama")[0]
    llm = LLM(base, dtype="bfloat16", enable_lora=True, max_lora_rank=16, kv_cache_space=0.02)
    ref = peft_first_logprobs(base, adapter, PROMPTS[0])
    got = first_token_logprobs(llm, PROMPTS[0], LoRARequest("a", 1, adapter))
    assert int(ref.argmax()) in got
    assert max(abs(lp - float(ref[t])) for t, lp in got.items()) < 0.1


def dequantized_folder(qfolder: str, out: str) -> str:
    """An HF folder of the w4a8 checkpoint's dequantized weights (PEFT's base for the comparison)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from armserve.model_loader.safetensors import iter_weights

    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    cfg = AutoConfig.from_pretrained(qfolder)
    del cfg.quantization_config
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    state = {n: t.float() for n, t in iter_weights(qfolder, quantized_config=True, dequantize=True)}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m or m == "lm_head.weight" for m in missing), (missing, unexpected)
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    for f in os.listdir(qfolder):
        if f.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(os.path.join(qfolder, f), tmp)
    os.replace(tmp, out)
    return out


def test_w4a8_base_keeps_quantized(bases):
    """A w4a8 base stays quantized (QuantizedLinear under the adapter), the adapter in float; the
    logprobs are within the int8-activation tolerance of PEFT on the dequantized base."""
    from armserve.quantization import QuantizedLinear
    from armserve.quantization.quantize import quantize_model

    base = bases["llama"]
    q = os.path.join(CACHE, "lora-w4a8-" + os.path.basename(base))
    if not os.path.isfile(os.path.join(q, "config.json")):
        shutil.rmtree(q, ignore_errors=True)
        quantize_model(base, q, lm_head="keep", dtype="float32", progress=False)
    deq = dequantized_folder(q, q + "-dequantized")
    adapter = adapters_of(base, "llama")[0]
    llm = LLM(q, dtype="float32", enable_lora=True, kv_cache_space=0.02)
    layer = llm.llm_engine.model.layers[0].self_attn.qkv_proj
    assert isinstance(layer, QuantizedLinear) and layer.lora is not None
    ref = peft_first_logprobs(deq, adapter, PROMPTS[1])
    got = first_token_logprobs(llm, PROMPTS[1], LoRARequest("a", 1, adapter))
    assert int(ref.argmax()) in got
    assert max(abs(lp - float(ref[t])) for t, lp in got.items()) < 0.15
    base_only = first_token_logprobs(llm, PROMPTS[1])
    assert base_only != got  # the adapter is applied over the quantized base


def test_prefix_cache_isolation_and_lru(bases):
    """Two adapters never share KV blocks (the same long prompt on each, then on the first again:
    hits only within one adapter); the CPU LRU drops the oldest adapter past max_cpu_loras and
    reads it again when asked; max_loras=1 runs requests on two adapters one after the other."""
    base = bases["llama"]
    a1, a2, a3 = adapters_of(base, "llama")
    llm = LLM(base, dtype="float32", enable_lora=True, max_loras=1, max_cpu_loras=2, kv_cache_space=0.02,
              block_size=16)
    eng = llm.llm_engine
    prompt = "one two three four five six seven eight nine ten " * 6
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    r1, r2, r3 = LoRARequest("a1", 1, a1), LoRARequest("a2", 2, a2), LoRARequest("a3", 3, a3)
    alone = [llm.generate([prompt], sp, use_tqdm=False, lora_request=r1)[0].outputs[0].token_ids]
    hits0 = eng.kv.prefix_hits
    alone.append(llm.generate([prompt], sp, use_tqdm=False, lora_request=r2)[0].outputs[0].token_ids)
    assert eng.kv.prefix_hits == hits0  # a2 finds none of a1's blocks
    out = llm.generate([prompt], sp, use_tqdm=False, lora_request=r1)[0]
    assert eng.kv.prefix_hits > hits0 and out.outputs[0].token_ids == alone[0]  # a hit within a1
    hits1 = eng.kv.prefix_hits
    graphs = eng.runner.graphs
    replays = graphs.replays
    llm.generate([prompt], sp, use_tqdm=False)  # the base: a miss
    assert eng.kv.prefix_hits == hits1
    # steps without an adapter keep their step graphs (LoRA steps record graphs of their own)
    assert not graphs.enabled or (graphs.replays > replays and graphs.lora_graphs)
    # both adapters in one call with max_loras=1: they take turns, each output as when run alone
    outs = llm.generate([prompt, prompt], sp, use_tqdm=False, lora_request=[r2, r1])
    assert [o.outputs[0].token_ids for o in outs] == [alone[1], alone[0]]
    assert list(eng.backend.lora.cpu) == [2, 1]
    llm.generate(["hi"], sp, use_tqdm=False, lora_request=r3)
    assert list(eng.backend.lora.cpu) == [1, 3]  # a2, least recently used, dropped
    assert llm.generate([prompt], sp, use_tqdm=False, lora_request=r2)[0].outputs[0].token_ids == alone[1]
    eng.kv.check_invariants()


def test_bad_adapters_are_named(bases, tmp_path):
    base = bases["llama"]
    good = adapters_of(base, "llama")[0]
    llm = LLM(base, dtype="float32", enable_lora=True, max_lora_rank=8, kv_cache_space=0.02)
    sp = SamplingParams(max_tokens=2)

    def refused(path: str, match: str, lora_id: int = 1) -> None:
        with pytest.raises(LoRAError, match=match):
            llm.generate(["hi"], sp, use_tqdm=False, lora_request=LoRARequest("bad", lora_id, path))

    refused(str(tmp_path / "nope"), "no such folder")
    (tmp_path / "empty").mkdir()
    refused(str(tmp_path / "empty"), "adapter_config.json is missing")
    weightless = tmp_path / "weightless"
    shutil.copytree(good, weightless)
    os.remove(weightless / "adapter_model.safetensors")
    refused(str(weightless), "adapter_model.safetensors is missing")
    refused(adapters_of(base, "llama")[2], "rank 16, above max_lora_rank 8")
    wrong = tmp_path / "wrong"
    shutil.copytree(good, wrong)
    from safetensors.torch import load_file, save_file

    t = load_file(str(wrong / "adapter_model.safetensors"))
    key = next(k for k in t if "q_proj.lora_A" in k)
    t[key] = torch.zeros(t[key].shape[0], 32)
    save_file(t, str(wrong / "adapter_model.safetensors"))
    refused(str(wrong), r"needs \[r, 64\]")
    for field, value, match in [("use_dora", True, "DoRA"), ("bias", "all", "biases"),
                                ("target_modules", ["q_proj", "embed_tokens"], "embed_tokens"),
                                ("modules_to_save", ["lm_head"], "modules_to_save")]:
        d = tmp_path / field
        shutil.copytree(good, d)
        cfg = json.loads((d / "adapter_config.json").read_text())
        cfg[field] = value
        (d / "adapter_config.json").write_text(json.dumps(cfg))
        refused(str(d), match)
    # the engine serves on, and an id may not name two adapters
    assert llm.generate(["hi"], sp, use_tqdm=False, lora_request=LoRARequest("good", 1, good))[0].outputs[0].token_ids
    refused(str(tmp_path / "empty"), "already names adapter 'good'", lora_id=1)
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        LLM(base, dtype="float32", kv_cache_space=0.02).generate(["hi"], sp, use_tqdm=False,
                                                                   lora_request=LoRARequest("good", 1, good))
    from armserve.config import ConfigError

    for kw, match in [(dict(backend="openvino"), "openvino"), (dict(speculative_config={"method": "ngram"}),
                                                                "speculative"),
                      (dict(tensor_parallel_size=2), "tensor_parallel_size"), (dict(max_cpu_loras=0), "max_cpu_loras")]:
        with pytest.raises(ConfigError, match=match):
            LLM(base, enable_lora=True, **kw)


# ---- llama.cpp GGUF LoRA files ---------------------------------------------------------------

HEADS = (TINY["num_attention_heads"], TINY["num_key_value_heads"])
GGUF_NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
              "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


def write_gguf_lora(peft_folder: str, path: str, arch: str, heads: tuple[int, int] | None = None,
                    extra: dict | None = None, q8: bool = False) -> str:
    """A PEFT adapter as llama.cpp's convert_lora_to_gguf.py writes it: general.type "adapter",
    adapter.type "lora", adapter.lora.alpha, `blk.N.<name>.weight.lora_a` [r, in] and `.lora_b`
    [out, r] in F32 (`q8`: as its --outtype q8_0, lora_a in Q8_0 blocks and lora_b, rows too short
    for a block, in F16); `heads` (attention, KV): the rows
    of q/k's lora_b permuted for llama.cpp's rotary, as the converter does for Llama-family
    bases. `extra`: tensors added as they are. (Checked once against the converter itself: the
    same header values and byte-identical tensors.)"""
    import re

    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize
    from safetensors.torch import load_file

    cfg = json.load(open(os.path.join(peft_folder, "adapter_config.json")))
    w = GGUFWriter(path, arch)
    w.add_type("adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", float(cfg["lora_alpha"]))
    for key, t in sorted(load_file(os.path.join(peft_folder, "adapter_model.safetensors")).items()):
        layer, module, ab = re.search(r"layers\.(\d+)\.\w+\.(\w+)\.lora_([AB])\.weight$", key).groups()
        if heads and ab == "B" and module in ("q_proj", "k_proj"):
            n = heads[0] if module == "q_proj" else heads[1]
            t = t.reshape(n, 2, t.shape[0] // n // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)
        a = np.ascontiguousarray(t.float().numpy())
        name = f"blk.{layer}.{GGUF_NAMES[module]}.weight.lora_{ab.lower()}"
        if q8 and ab == "A":
            w.add_tensor(name, quantize(a, GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0)
        elif q8:
            w.add_tensor(name, a.astype(np.float16))
        else:
            w.add_tensor(name, a)
    for name, t in (extra or {}).items():
        w.add_tensor(name, np.ascontiguousarray(t.float().numpy()))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def gguf_adapters(base: str, family: str, out: str) -> list[tuple[str, str]]:
    """(PEFT folder, its GGUF LoRA file) of two of `adapters_of` (rsLoRA has no GGUF form)."""
    heads = HEADS if family == "llama" else None  # (Qwen2's q/k are not permuted)
    return [(a, write_gguf_lora(a, os.path.join(out, f"{family}-{i}.gguf"), family, heads))
            for i, a in enumerate(adapters_of(base, family)[::2])]


@pytest.mark.parametrize("family, gguf_base", [("llama", False), ("qwen2", False), ("llama", True)])
def test_gguf_lora_matches_peft(bases, tmp_path, family, gguf_base):
    """llama.cpp GGUF LoRA files (q/k's lora_b in llama.cpp's row order for Llama) on a Hugging Face
    base and on a `llama` GGUF base (its q/k rows permuted too): two adapters and the base in one
    batch give PEFT's greedy tokens on the same base + adapter folder, logprobs close."""
    base = bases[family]
    pairs = gguf_adapters(base, family, str(tmp_path))
    model, tokenizer = base, None
    if gguf_base:
        from test_tp import write_llama_gguf

        model, tokenizer = str(tmp_path / "base.gguf"), base
        write_llama_gguf(base, model, f32=True)
    llm = LLM(model, tokenizer=tokenizer, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16,
              kv_cache_space=0.02)
    sp = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=0)
    runs = [(None, None)] + [(LoRARequest(f"g{i}", i + 1, g), peft) for i, (peft, g) in enumerate(pairs)]
    outs = llm.generate(PROMPTS[:2] * len(runs), sp, use_tqdm=False,
                        lora_request=[lora for lora, _ in runs for _ in PROMPTS[:2]])
    for out, (_, peft) in zip(outs, [r for r in runs for _ in PROMPTS[:2]]):
        got = out.outputs[0]
        assert_peft_greedy(base, peft, out.prompt, list(got.token_ids),
                           [next(iter(d.values())).logprob for d in got.logprobs])
    assert len({tuple(o.outputs[0].token_ids) for o in outs[::2]}) > 1  # the adapters change the output


def test_bad_gguf_lora_files_are_named(bases, tmp_path):
    """A GGUF file that is no LoRA of this base is a LoRAError naming why; the engine serves on,
    and runs a good file in Q8_0 blocks close to PEFT."""
    from test_tp import write_llama_gguf

    base = bases["llama"]
    peft = adapters_of(base, "llama")
    llm = LLM(base, dtype="float32", enable_lora=True, max_lora_rank=8, kv_cache_space=0.02)
    sp = SamplingParams(max_tokens=2)

    def refused(path: str, match: str) -> None:
        with pytest.raises(LoRAError, match=match):
            llm.generate(["hi"], sp, use_tqdm=False, lora_request=LoRARequest("bad", 1, path))

    model_file = str(tmp_path / "model.gguf")
    write_llama_gguf(base, model_file, f32=True)
    refused(model_file, "not 'adapter': a model file")
    (tmp_path / "text.gguf").write_text("not a gguf file")
    refused(str(tmp_path / "text.gguf"), "nor a readable GGUF file")
    refused(write_gguf_lora(peft[0], str(tmp_path / "q.gguf"), "qwen2"), "architecture 'qwen2'")
    refused(write_gguf_lora(peft[2], str(tmp_path / "r16.gguf"), "llama", HEADS), "rank 16, above max_lora_rank 8")
    wide = {"blk.0.attn_output.weight.lora_a": torch.zeros(8, 32), "blk.0.attn_output.weight.lora_b": torch.zeros(64, 8)}
    refused(write_gguf_lora(peft[1], str(tmp_path / "w.gguf"), "llama", HEADS, wide),
            r"blk.0.attn_output.weight has lora_a \(8, 32\).*needs \[r, 64\]")
    embd = {"token_embd.weight.lora_a": torch.zeros(4, 8), "token_embd.weight.lora_b": torch.zeros(64, 4)}
    refused(write_gguf_lora(peft[0], str(tmp_path / "e.gguf"), "llama", HEADS, embd), "embedding or LM-head")
    half = {"blk.1.attn_output.weight.lora_a": torch.zeros(8, 64)}
    refused(write_gguf_lora(peft[1], str(tmp_path / "h.gguf"), "llama", HEADS, half), "has lora_a but no lora_b")
    good = write_gguf_lora(peft[0], str(tmp_path / "good.gguf"), "llama", HEADS, q8=True)
    ref = peft_first_logprobs(base, peft[0], PROMPTS[0])
    got = first_token_logprobs(llm, PROMPTS[0], LoRARequest("good", 2, good))
    assert int(ref.argmax()) in got
    assert max(abs(lp - float(ref[t])) for t, lp in got.items()) < 0.15  # (the adapter rounded to 8 bits)


# ---- the server ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lora_server(bases, tmp_path_factory):
    """Two adapters by name (both --lora-modules forms) and one as a GGUF file, runtime updates
    allowed, an API key."""
    from server_process import API_KEY, ServerProcess

    a1, a2, _ = adapters_of(bases["llama"], "llama")
    g1 = write_gguf_lora(a1, str(tmp_path_factory.mktemp("gguf-lora") / "a1.gguf"), "llama", HEADS)
    srv = ServerProcess(bases["llama"], [
        "--dtype", "float32", "--kv-cache-space", "0.02", "--served-model-name", "base", "--enable-lora",
        "--max-loras", "2", "--lora-modules", f"a1={a1}", json.dumps({"name": "a2", "path": a2}), f"g1={g1}"],
        str(tmp_path_factory.mktemp("lora") / "server.log"),
        env={"ARMSERVE_API_KEY": API_KEY, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"})
    yield srv
    srv.stop()


def test_server_adapters_by_model_name(bases, lora_server):
    import openai

    from server_process import API_KEY

    base = bases["llama"]
    a1, a2, a3 = adapters_of(base, "llama")
    client = openai.OpenAI(base_url=lora_server.base_url, api_key=API_KEY)
    for model, adapter in [("a1", a1), ("a2", a2), ("g1", a1), ("base", None)]:
        r = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=6, temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
        assert r.model == model
        assert_peft_greedy(base, adapter, PROMPTS[0], r.choices[0].token_ids)
    chat = client.chat.completions.create(model="a2", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert chat.model == "a2" and chat.choices[0].message.content is not None
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="a9", prompt="hi", max_tokens=2)
    cards = {m.id: m for m in client.models.list().data}
    assert cards["a1"].parent == "base" and cards["a1"].root == a1 and cards["base"].parent is None

    # runtime load / unload: the API key is required, a bad folder is a 400 naming it
    import httpx

    auth = {"Authorization": f"Bearer {API_KEY}"}
    url = lora_server.url
    assert httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "a3", "lora_path": a3}).status_code == 401
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": "/nonexistent/x"},
                   headers=auth, timeout=60)
    assert r.status_code == 400 and "/nonexistent/x" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": __file__},
                   headers=auth, timeout=60)
    assert r.status_code == 400 and "nor a readable GGUF file" in r.json()["error"]["message"]
    g3 = write_gguf_lora(a3, os.path.join(os.path.dirname(cards["g1"].root), "a3.gguf"), "llama", HEADS)
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "g3", "lora_path": g3}, headers=auth, timeout=60)
    assert r.status_code == 200, r.text
    r = client.completions.create(model="g3", prompt=PROMPTS[0], max_tokens=6, temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
    assert_peft_greedy(base, a3, PROMPTS[0], r.choices[0].token_ids)
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "a3", "lora_path": a3}, headers=auth, timeout=60)
    assert r.status_code == 200, r.text
    assert httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "a3", "lora_path": a3},
                      headers=auth).status_code == 400  # already loaded
    r = client.completions.create(model="a3", prompt=PROMPTS[0], max_tokens=6, temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
    assert_peft_greedy(base, a3, PROMPTS[0], r.choices[0].token_ids)
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "a3"}, headers=auth).status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="a3", prompt="hi", max_tokens=2)
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "a3"}, headers=auth).status_code == 404
    assert httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "x"}, headers=auth).status_code == 400


def test_runtime_updates_off_without_env(server):
    """Without VLLM_ALLOW_RUNTIME_LORA_UPDATING the routes do not exist (vLLM's 404)."""
    import httpx

    r = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"})
    assert r.status_code == 404
