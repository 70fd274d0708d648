"""`armserve quantize MODEL OUT --scheme w4a8`: write an int4-weight checkpoint folder.

Output: `model.safetensors` (or shards plus an index), config.json with a `quantization_config`
section, and the tokenizer. Every linear weight of the decoder layers becomes int4 codes with
one scale (and zero point) per group (stored as checkpoint.py says), each group's scale and zero
chosen to minimise its squared rounding error (formats.quantize_weight). Embeddings and norms
stay in `--dtype`. An untied LM head becomes int8 by default (`--lm-head int8|int4|keep`).
`LLM(OUT)` and `armserve serve OUT` load the folder directly and run it with the w4a8 kernels
(activations quantized to int8 on the fly).
"""

from __future__ import annotations

import os
import shutil

import torch

from armserve import model_loader
from armserve.quantization import checkpoint
from armserve.quantization.formats import quantize_weight, quantize_weight_int8

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
    untie_lm_head: bool = False,
) -> dict:
    """Quantize `model` (HF folder or GGUF) into the folder `out`; returns the quantization_config.

    `lm_head`: "int8" (default: per-row groups of 32, symmetric; an untied LM head is a large share
    of a small model's bytes, e.g. 272 of 630 MB in Qwen2.5-0.5B, and int8 keeps it within ~0.4% of
    each group's range), "int4" (the scheme's own format) or "keep" (`dtype`).
    `untie_lm_head`: a head tied to the embedding table gets a copy of it in the `lm_head` format
    and the config is untied (for a quantized self-draft: SmolLM2's float32 table is twice the
    bytes of its int4 layers, read by every draft step).
    """
    from huggingface_hub import save_torch_state_dict
    from tqdm.auto import tqdm

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
    if checkpoint.armserve_quantization(config):
        raise ValueError(f"{src.path} is already quantized by armserve")
    # (a GGUF file's names mapped by its family: Qwen3's q/k norms, Gemma's norm offset, DeepSeek's MLA)
    weights = list(model_loader.checkpoint_weights(src, config, dequantize=True))
    if untie_lm_head and getattr(config, "tie_word_embeddings", False) and lm_head != "keep" and not any(
            n == "lm_head.weight" for n, _ in weights):
        embed = next((w for n, w in weights if n.endswith("embed_tokens.weight")), None)
        if embed is not None:
            weights.append(("lm_head.weight", embed))
            config.tie_word_embeddings = False
    for name, w in tqdm(weights, desc="Quantizing", unit="tensor", dynamic_ncols=True, disable=not progress):
        if wanted(name) and w.dim() == 2:
            g = w.shape[1] if group_size == "channel" else group_size
            out_t = checkpoint.encode(name[: -len(".weight")], quantize_weight(w, g, symmetric), symmetric)
            names_done.append(name)
        elif lm_head == "int8" and name == "lm_head.weight" and not skipped(name):
            out_t = checkpoint.encode("lm_head", quantize_weight_int8(w), symmetric)
        else:
            # Norms (1-D) stay float32: they are tiny and precision-sensitive.
            out_t = {name: w.contiguous() if w.dim() == 1 else w.to(keep_dtype).contiguous()}
        tensors.update(out_t)
    if not names_done:
        raise ValueError(f"no linear weights to quantize in {model!r}")
    os.makedirs(out, exist_ok=True)
    # model.safetensors, or shards of at most SHARD_BYTES with model.safetensors.index.json
    save_torch_state_dict(tensors, out, max_shard_size=SHARD_BYTES)

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
