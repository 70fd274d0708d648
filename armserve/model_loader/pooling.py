"""A checkpoint's pooling, from its sentence-transformers files: `modules.json` lists the modules
(Transformer, Pooling, Normalize, ...), the Pooling module's folder holds `config.json`
(`pooling_mode_cls_token` / `pooling_mode_mean_tokens` / `pooling_mode_lasttoken`, or
`pooling_mode` in newer files), and `sentence_bert_config.json` the sequence length it was used
with. Without them, the model family's default (vLLM's: CLS for encoders) with normalization.
"""

from __future__ import annotations

import json
import os
from typing import Any

from armserve.pooling_params import PoolerConfig
from armserve.model_loader import gguf
from armserve.model_source import ModelLoadError, ModelSource

# sentence-transformers Pooling modes -> armserve's
_MODES = {"cls": "CLS", "mean": "MEAN", "lasttoken": "LAST"}
# the boolean keys of older Pooling configs -> mode (max, mean_sqrt_len, weightedmean: not supported)
_FLAGS = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_max_tokens": "max",
          "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len", "pooling_mode_weightedmean_tokens": "weightedmean",
          "pooling_mode_lasttoken": "lasttoken"}


def _read_json(path: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e


def pooler_config(src: ModelSource, config, default_type: str, task: str = "embed") -> PoolerConfig:
    """The checkpoint's pooling (`config`: its transformers config, for the vector size and
    Matryoshka dimensions); `default_type` when it has no sentence-transformers files. A
    cross-encoder (`task` "classify") pools its first token into its head: `num_labels` scores."""
    if task == "classify":
        return PoolerConfig("CLS", False, config.num_labels, None, "classify")
    size = config.hidden_size
    dims = getattr(config, "matryoshka_dimensions", None)
    matryoshka = tuple(int(d) for d in dims) if dims else (() if getattr(config, "is_matryoshka", False) else None)
    modules_path = os.path.join(src.folder, "modules.json")
    if src.is_gguf:
        # the header's pooling_type; normalized, as llama-server's embeddings are by default
        mode = gguf.pooling_type(src) or default_type
        if mode == "RANK":
            raise ModelLoadError(f"{src.gguf_file} is a reranker (pooling_type rank): not supported from GGUF yet")
        return PoolerConfig(mode, True, size, matryoshka)
    if not os.path.isfile(modules_path):
        return PoolerConfig(default_type, True, size, matryoshka)
    modules = _read_json(modules_path)
    if not isinstance(modules, list):
        raise ModelLoadError(f"{modules_path} is not a list of modules")
    types = {m.get("type", "").rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
    if "Dense" in types:
        raise ModelLoadError(f"{modules_path} has a Dense module (a projection after pooling): not supported")
    normalize = "Normalize" in types
    pooling = types.get("Pooling")
    if pooling is None:
        return PoolerConfig(default_type, normalize, size, matryoshka)
    cfg = _read_json(os.path.join(src.folder, pooling.get("path", ""), "config.json"))
    mode = cfg.get("pooling_mode")
    if mode is None:
        on = [m for key, m in _FLAGS.items() if cfg.get(key)]
        mode = on[0] if len(on) == 1 else "+".join(on)  # (several: concatenated, not supported)
    if mode not in _MODES:
        raise ModelLoadError(f"{pooling.get('path')}/config.json asks for pooling {mode or cfg!r}; "
                             f"supported: {', '.join(_MODES)}")
    return PoolerConfig(_MODES[mode], normalize, size, matryoshka)


def sentence_max_len(src: ModelSource) -> int | None:
    """`max_seq_length` of sentence_bert_config.json: the length the model was trained to
    embed (the default max_model_len; sentence-transformers truncates there too)."""
    path = os.path.join(src.folder, "sentence_bert_config.json")
    if src.is_gguf or not os.path.isfile(path):
        return None
    n = _read_json(path).get("max_seq_length")
    return int(n) if isinstance(n, int) and n > 0 else None
