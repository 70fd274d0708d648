"""Find, check and load a model: a Hugging Face folder (config.json + safetensors + tokenizer,
safetensors.py) or a single GGUF file (config, tokenizer and weights from one file, gguf.py).
The model class comes from the registry in armserve/models/."""

from __future__ import annotations

import os
from typing import Iterator

import torch
from torch import nn
# (transformers at import time, not inside the first LLM's constructor: its import leaves a few
# exception-and-traceback cycles behind, and their frames' callers would then be the constructor's
# frames, holding the engine (model, KV cache, compile workers) until the cyclic collector ran,
# however soon the LLM was deleted)
from transformers import AutoConfig, AutoTokenizer

from armserve.layers.linear import ParallelContext, parallel_context
from armserve.model_loader import gguf, safetensors
from armserve.model_loader.tokenizer_cache import cached_gguf_tokenizer, is_cached
from armserve.model_source import (ModelLoadError, ModelSource, bundled_model_path, generation_defaults,
                                   resolve_model_path)
from armserve.memory import release_free_heap
from armserve.models import UnsupportedArchitectureError, get_model_class, model_type_class
from armserve.quantization import QuantizedTensor
from armserve.quantization.checkpoint import armserve_quantization

__all__ = ["ModelLoadError", "ModelSource", "bundled_model_path", "checkpoint_dtype", "checkpoint_weights",
           "eos_token_ids", "generation_defaults", "load_config", "load_model", "load_tokenizer", "resolve_model_path"]


def load_config(src: ModelSource, overrides: dict | None = None):
    """The transformers config of the model, with `architectures` filled in, then `overrides`
    (vLLM's `hf_overrides`: keys set on the config, e.g. the original Qwen3-Reranker's
    `{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
    "is_original_qwen3_reranker": true}`)."""
    try:
        if src.is_gguf:
            # (the vocabulary converted only when the tokenizer will be made from it: a converted
            # one is read from the cache, tokenizer_cache.py)
            config = gguf.read_config(src, vocabulary=not is_cached(os.path.join(src.folder, src.gguf_file)))
        else:
            config = AutoConfig.from_pretrained(src.folder)
    except UnsupportedArchitectureError:
        raise
    except (OSError, ValueError, KeyError, TypeError) as e:  # (a bad config.json: a ValueError)
        what = src.gguf_file or "config.json"
        raise ModelLoadError(f"cannot read the model config from {what} in {src.folder}: {e}") from e
    if not getattr(config, "architectures", None):
        config.architectures = [model_type_class(config.model_type).architectures[0]]
    for key, value in (overrides or {}).items():
        setattr(config, key, value)
    if overrides and "architectures" in overrides:
        archs = config.architectures
        if not isinstance(archs, list) or not archs or not all(isinstance(a, str) for a in archs):
            raise ModelLoadError(f"hf_overrides: architectures must be a list of names, got {archs!r}")
        get_model_class(archs[0])  # an unknown one fails here, by name
    return config


def load_tokenizer(src: ModelSource, tokenizer: str | None = None):
    """The model's tokenizer, or `tokenizer`'s: an HF folder or name, a GGUF file, or a
    tokenizer.json file (with the tokenizer_config.json beside it, if any)."""
    what = f"the tokenizer {tokenizer}" if tokenizer else f"the tokenizer of {src.path}"
    # (transformers reads no tokenizer from some GGUF architectures, llama.cpp's deepseek2 among them)
    hint = "; pass tokenizer= (--tokenizer) an HF folder or file with the model's tokenizer" if not tokenizer else ""
    try:
        if tokenizer and os.path.isfile(tokenizer):
            folder, name = os.path.split(os.path.abspath(tokenizer))
            if name.endswith(".gguf"):
                tok = cached_gguf_tokenizer(tokenizer, lambda: AutoTokenizer.from_pretrained(folder, gguf_file=name))
            elif name == "tokenizer.json":
                tok = AutoTokenizer.from_pretrained(folder)
            else:
                raise ModelLoadError(f"the tokenizer {tokenizer} is neither a folder, a GGUF file nor a tokenizer.json")
        elif tokenizer:
            tok = AutoTokenizer.from_pretrained(tokenizer)
        elif src.is_gguf and gguf.tokenizer_model(src) == "bert":
            tok = gguf.wordpiece_tokenizer(src)  # (transformers reads no WordPiece vocabulary from GGUF)
        elif src.is_gguf:
            def convert():
                with gguf.shared_with_transformers(src):
                    return AutoTokenizer.from_pretrained(src.folder, gguf_file=src.gguf_file)

            tok = cached_gguf_tokenizer(os.path.join(src.folder, src.gguf_file), convert)
        else:
            tok = AutoTokenizer.from_pretrained(src.folder)
    except ModelLoadError:
        raise
    except Exception as e:  # transformers raises many kinds here
        raise ModelLoadError(f"cannot load {what}: {e}{hint}") from e
    # NOTE: from a folder with a config.json and no tokenizer files, transformers builds a tokenizer
    # with no vocabulary (only its special tokens): every prompt would become unknown tokens.
    if len(tok) <= len(tok.all_special_tokens):
        raise ModelLoadError(f"cannot load {what}: it has no vocabulary ({len(tok)} tokens){hint}")
    return tok


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


def checkpoint_weights(src: ModelSource, config, dequantize: bool = False
                       ) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """The checkpoint's tensors under Hugging Face names (GGUF names mapped by the model class);
    quantized ones (GGUF blocks feeding a linear layer, `armserve quantize` weights) as
    QuantizedTensors unless `dequantize`."""
    if src.is_gguf:
        cls = get_model_class(config.architectures[0])
        return gguf.iter_weights(os.path.join(src.folder, src.gguf_file), config, cls, keep_quantized=not dequantize)
    return safetensors.iter_weights(src.folder, armserve_quantization(config) is not None, dequantize)


def load_model(src: ModelSource, config, dtype: torch.dtype, quantization: str | None = None,
               parallel: ParallelContext | None = None, model_class: type[nn.Module] | None = None,
               share_weights: bool = False) -> nn.Module:
    """Build the model for `config` in `dtype` and fill it from the checkpoint.

    Quantized weights (GGUF Q4_0/Q4_1/Q4_K/Q5_0/Q8_0/Q6_K, `armserve quantize` output) stay
    quantized unless `quantization == "none"`. `parallel`: the tensor-parallel rank to build (its
    layers keep only their part of each weight, layers/linear.py); None: the whole model.
    `model_class`: the class to build (the pooling runner's adaptation of a decoder); None: the
    one `config.architectures` names. `share_weights`: map the large weights from a file that
    every engine loading the same model maps too (weight_cache.py).
    """
    dequantize = quantization == "none"
    cls = model_class or get_model_class(config.architectures[0])
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with parallel_context(parallel):
            model = cls(config)
    finally:
        torch.set_default_dtype(prev)
    expected = model.expected_weights()
    loaded = model.load_weights(checkpoint_weights(src, config, dequantize))
    missing = expected - loaded
    if missing:
        shown = ", ".join(sorted(missing)[:5])
        raise ModelLoadError(
            f"checkpoint {src.path} is missing {len(missing)} weight(s), e.g. {shown}"
        )
    model.process_weights_after_loading()  # repack the weights into the kernel layouts once
    model.eval()
    if share_weights:
        from armserve import kernels
        from armserve.model_loader.weight_cache import cache_key, share_weights as share

        files = [os.path.join(src.folder, src.gguf_file)] if src.is_gguf else sorted(
            os.path.join(src.folder, n) for n in os.listdir(src.folder) if n.endswith((".safetensors", ".json")))
        share(model, cache_key([gguf._file_key(f) for f in files], str(dtype), quantization, cls.__name__,
                               (parallel.rank, parallel.world) if parallel else None, kernels.available()))
    release_free_heap()
    return model

