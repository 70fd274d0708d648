"""`armserve quantize MODEL OUT --scheme w4a8`: write an int4-weight checkpoint folder.

Output: `model.safetensors` (or shards plus an index), config.json with a `quantization_config`
section, and the tokenizer. Every linear weight of the decoder layers becomes
    {name}.qweight  uint8 [n, k / 2]   two 4-bit codes per byte, low nibble = even column
    {name}.scales   float16 [n, k / g]  one scale per group of g columns
    {name}.zeros    float16 [n, k / g]  zero point in code units (asymmetric only; symmetric uses 8)
so that w = scale * (code - zero), each group's scale and zero chosen to minimise its squared
rounding error (quantized_linear.quantize_weight). Embeddings and norms stay in `--dtype`. An untied LM head
becomes int8 by default (`--lm-head int8|int4|keep`):
    lm_head.qweight int8 [n, k]        symmetric codes, w = scale * code
    lm_head.scales  float16 [n, k / 32]
`LLM(OUT)` and `armserve serve OUT` load the folder directly and run it with the w4a8 kernels
(activations quantized to int8 on the fly).
"""

from __future__ import annotations

import json
import os
import shutil

import torch

from armserve import model_loader
from armserve.layers.quantized_linear import quantize_weight, quantize_weight_int8

# Decoder-layer projections that are quantized (MoE experts included: Mixtral names its experts'
# gate/down/up w1/w2/w3; DeepSeek's shared experts, MLA's q projections and kv down-projection
# too); anything else is copied, routers (`mlp.gate`) too. NOTE: MLA's kv up-projection kv_b_proj
# stays float: it is absorbed into the query and the output as per-head matrices (layers/mla.py),
# not run as a GEMM, and an int4 error there would enter every attention score; it is ~0.4% of
# DeepSeek-V2-Lite's weights.
LINEAR_SUFFIXES = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
                   "gate_proj.weight", "up_proj.weight", "down_proj.weight",
                   ".w1.weight", ".w2.weight", ".w3.weight",
                   "q_a_proj.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight")
SHARD_BYTES = 2 * 2**30


def _float_weights(src: model_loader.ModelSource, config):
    if model_loader.armserve_quantization(config):
        raise ValueError(f"{src.path} is already quantized by armserve")
    # (a GGUF file's names mapped by its family: Qwen3's q/k norms, Gemma's norm offset, DeepSeek's MLA)
    return model_loader.checkpoint_weights(src, config, dequantize=True)


def quantize_model(
    model: str,
    out: str,
    scheme: str = "w4a8",
    group_size: int | str = 32,
    symmetric: bool = False,
    lm_head: str = "int8",
    skip_modules: list[str] | None = None,
    dtype: str = "bfloat16",
    progress: bool = True,
) -> dict:
    """Quantize `model` (HF folder or GGUF) into the folder `out`; returns the quantization_config.

    `lm_head`: "int8" (default: per-row groups of 32, symmetric; an untied LM head is a large share
    of a small model's bytes, e.g. 272 of 630 MB in Qwen2.5-0.5B, and int8 keeps it within ~0.4% of
    each group's range), "int4" (the scheme's own format) or "keep" (`dtype`).
    """
    from safetensors.torch import save_file

    if lm_head not in ("int8", "int4", "keep"):
        raise ValueError(f"lm_head must be int8, int4 or keep, got {lm_head!r}")
    if scheme != "w4a8":
        raise ValueError(f"unknown scheme {scheme!r}; supported: w4a8")
    if group_size != "channel":
        try:
            group_size = int(group_size)
        except ValueError:
            raise ValueError(f"group size must be 32, 64, 128 or 'channel', got {group_size!r}") from None
        if group_size not in (32, 64, 128):
            raise ValueError(f"group size must be 32, 64, 128 or 'channel', got {group_size}")
    keep_dtype = getattr(torch, dtype, None)
    if keep_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"--dtype must be float32, bfloat16 or float16, got {dtype!r}")
    if os.path.exists(out) and os.listdir(out):
        raise ValueError(f"output folder {out!r} exists and is not empty")
    src = model_loader.resolve_model_path(model)
    config = model_loader.load_config(src)
    tokenizer = model_loader.load_tokenizer(src)
    skip = list(skip_modules or [])

    def skipped(name: str) -> bool:
        return any(s in name for s in skip)

    def wanted(name: str) -> bool:
        int4_head = lm_head == "int4" and name == "lm_head.weight"
        return not skipped(name) and (name.endswith(LINEAR_SUFFIXES) or int4_head)

    names_done: list[str] = []
    tensors: dict[str, torch.Tensor] = {}
    shards: list[dict[str, torch.Tensor]] = []
    size = 0
    weights = list(_float_weights(src, config))
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(weights), desc="Quantizing", unit="tensor", dynamic_ncols=True)
    for name, w in weights:
        if wanted(name) and w.dim() == 2:
            g = w.shape[1] if group_size == "channel" else group_size
            qt = quantize_weight(w, g, symmetric)
            prefix = name[: -len(".weight")]
            codes = qt.codes
            out_t = {
                prefix + ".qweight": (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous(),
                prefix + ".scales": qt.scales.to(torch.float16),
            }
            if not symmetric:
                out_t[prefix + ".zeros"] = (qt.szp / qt.scales).to(torch.float16)
            names_done.append(name)
        elif lm_head == "int8" and name == "lm_head.weight" and not skipped(name):
            qt = quantize_weight_int8(w)
            # int8 codes are stored as they are (a .qweight of dtype int8 marks the format)
            out_t = {"lm_head.qweight": qt.codes.contiguous(), "lm_head.scales": qt.scales.to(torch.float16)}
        else:
            # Norms (1-D) stay float32: they are tiny and precision-sensitive.
            out_t = {name: w.contiguous() if w.dim() == 1 else w.to(keep_dtype).contiguous()}
        for k, v in out_t.items():
            nbytes = v.numel() * v.element_size()
            if tensors and size + nbytes > SHARD_BYTES:
                shards.append(tensors)
                tensors, size = {}, 0
            tensors[k] = v
            size += nbytes
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    if not names_done:
        raise ValueError(f"no linear weights to quantize in {model!r}")
    shards.append(tensors)

    os.makedirs(out, exist_ok=True)
    if len(shards) == 1:
        save_file(shards[0], os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(out, fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in shard})
        with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)

    qcfg = {
        "quant_method": "armserve",
        "scheme": scheme,
        "bits": 4,
        "group_size": group_size,
        "symmetric": symmetric,
        "activations": "int8, dynamic, per token and weight group",
        "lm_head": "keep" if skipped("lm_head.weight") else lm_head,
        "modules_not_converted": sorted({"embed_tokens", "norm"} | ({"lm_head"} if lm_head == "keep" else set())
                                        | set(skip)),
    }
    config.quantization_config = qcfg
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if not src.is_gguf:
        gen = os.path.join(src.folder, "generation_config.json")
        if os.path.isfile(gen):
            shutil.copy(gen, out)
    return qcfg
