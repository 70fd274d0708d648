"""The model families: each module here lists its model classes in `MODELS`, and each class
declares the names checkpoints give it (config.json `architectures`, transformers `model_type`s,
llama.cpp's GGUF `general.architecture`s). Adding a family is adding its module: it is found here.
"""

from __future__ import annotations

import importlib
import pkgutil

from torch import nn


class UnsupportedArchitectureError(ValueError):
    """The checkpoint's architecture has no implementation here."""


def _collect() -> tuple[dict[str, type[nn.Module]], dict[str, type[nn.Module]], dict[str, type[nn.Module]]]:
    """(architecture, model_type, GGUF architecture) -> class, over every family module."""
    tables: tuple[dict[str, type[nn.Module]], ...] = ({}, {}, {})
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        for cls in getattr(module, "MODELS", ()):
            names = (cls.architectures, cls.model_types, cls.gguf_architectures)
            for table, keys in zip(tables, names):
                for key in keys:
                    if key in table:  # (a subclass that forgot to declare its own names)
                        raise RuntimeError(f"{key!r} is claimed by {table[key].__name__} and {cls.__name__}")
                    table[key] = cls
    return tables  # type: ignore[return-value]


MODEL_REGISTRY, MODEL_TYPES, GGUF_ARCHITECTURES = _collect()


def _lookup(table: dict[str, type[nn.Module]], key: str, what: str) -> type[nn.Module]:
    try:
        return table[key]
    except KeyError:
        raise UnsupportedArchitectureError(
            f"{what} {key!r} is not supported; supported: {', '.join(sorted(table))}") from None


def get_model_class(architecture: str) -> type[nn.Module]:
    """The class of a config.json `architectures` name."""
    return _lookup(MODEL_REGISTRY, architecture, "architecture")


def model_type_class(model_type: str) -> type[nn.Module]:
    """The class of a transformers `model_type` (a config with no `architectures`, as from GGUF)."""
    return _lookup(MODEL_TYPES, model_type, "model_type")


def gguf_model_class(gguf_architecture: str) -> type[nn.Module]:
    """The class whose `gguf_config` reads a GGUF file of this `general.architecture`."""
    return _lookup(GGUF_ARCHITECTURES, gguf_architecture, "GGUF architecture")
