"""The names a server answers to: the base model's and its LoRA adapters' (vLLM's serving_models).

A request's `model` picks what runs: a base name runs the base model, an adapter name runs the
base with that adapter (`--lora-modules name=path`, or loaded at run time through
POST /v1/load_lora_adapter when VLLM_ALLOW_RUNTIME_LORA_UPDATING is true); any other name is a 404.
`/v1/models` lists the adapters with `parent` = the base's first name and `root` = their folder.
"""

from __future__ import annotations

import itertools
import json
import os
from typing import Any

from armserve.engine.async_llm import AsyncLLM
from armserve.entrypoints.protocol import APIError
from armserve.lora.request import LoRARequest

RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_lora_updating() -> bool:
    """vLLM's switch for the load/unload endpoints (off unless the variable says true/1)."""
    return os.environ.get(RUNTIME_LORA_ENV, "").strip().lower() in ("1", "true", "yes")


def parse_lora_modules(values: list[str] | None) -> list[tuple[str, str, str | None]]:
    """(name, path, base model name) of each `--lora-modules` value: `name=path` or vLLM's JSON
    form '{"name": ..., "path": ..., "base_model_name": ...}'; a ValueError names a bad one."""
    out = []
    for v in values or []:
        if v.lstrip().startswith("{"):
            try:
                obj = json.loads(v)
            except json.JSONDecodeError as e:
                raise ValueError(f"--lora-modules {v!r} is not valid JSON: {e}") from None
            if not isinstance(obj, dict) or not obj.get("name") or not obj.get("path"):
                raise ValueError(f"--lora-modules {v!r}: the JSON form needs \"name\" and \"path\"")
            out.append((str(obj["name"]), str(obj["path"]), obj.get("base_model_name")))
        else:
            name, eq, path = v.partition("=")
            if not eq or not name or not path:
                raise ValueError(f"--lora-modules {v!r}: expected name=path or a JSON object")
            out.append((name, path, None))
    names = [n for n, _, _ in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"--lora-modules names {', '.join(dup)} more than once")
    return out


class ServingModels:
    """The served names and adapters of one server."""

    def __init__(self, engine: AsyncLLM, base_names: list[str],
                 lora_modules: list[tuple[str, str, str | None]] | None = None) -> None:
        self.engine = engine
        self.base_names = base_names
        self.loras: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)  # never reused: the KV prefix cache keys on the id
        for name, path, base in lora_modules or []:
            self._check_name(name)
            self.loras[name] = LoRARequest(name, next(self._ids), path, base)

    async def check_adapters(self) -> None:
        """Read every `--lora-modules` adapter in the engine now (a bad one: a ValueError naming it)."""
        for req in self.loras.values():
            await self.engine.add_lora(req)

    def _check_name(self, name: str) -> None:
        if not self.engine.config.enable_lora:
            raise ValueError("LoRA adapters need --enable-lora")
        if name in self.base_names:
            raise ValueError(f"LoRA adapter name {name!r} is the base model's served name")

    def model_name(self, requested: str | None) -> str:
        """The name to answer with; 404 for a model this server does not serve."""
        if requested is None or requested == "":
            return self.base_names[0]
        if requested not in self.base_names and requested not in self.loras:
            raise APIError(f"The model '{requested}' does not exist; this server serves "
                           f"{', '.join(repr(n) for n in [*self.base_names, *self.loras])}.",
                           404, "model", "model_not_found")
        return requested

    def lora_request(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model)."""
        return self.loras.get(model) if model else None

    def cards(self, created: int) -> list[dict[str, Any]]:
        """/v1/models' entries: the base names, then the adapters (parent: the base's first name)."""
        common = {"object": "model", "created": created, "owned_by": "armserve",
                  "max_model_len": self.engine.max_model_len}
        return [{"id": n, **common, "root": self.engine.config.model, "parent": None} for n in self.base_names] + [
            {"id": n, **common, "root": r.lora_path, "parent": r.base_model_name or self.base_names[0]}
            for n, r in self.loras.items()]

    def card(self, name: str, created: int) -> dict[str, Any]:
        return next(c for c in self.cards(created) if c["id"] == self.model_name(name))

    async def load(self, body: Any) -> str:
        """POST /v1/load_lora_adapter {lora_name, lora_path}: read and check it in every engine."""
        name, path = self._fields(body, "lora_path")
        if name in self.loras:
            raise APIError(f"The lora adapter '{name}' has already been loaded.", 400, "lora_name")
        try:
            self._check_name(name)
        except ValueError as e:
            raise APIError(str(e), 400, "lora_name") from None
        req = LoRARequest(name, next(self._ids), path)
        try:
            await self.engine.add_lora(req)
        except ValueError as e:  # a bad folder: named; the server serves on
            raise APIError(str(e), 400, "lora_path") from None
        self.loras[name] = req
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, body: Any) -> str:
        """POST /v1/unload_lora_adapter {lora_name}: forget it (requests naming it get 404)."""
        name, _ = self._fields(body, None)
        req = self.loras.pop(name, None)
        if req is None:
            raise APIError(f"The lora adapter '{name}' cannot be found.", 404, "lora_name", "model_not_found")
        await self.engine.remove_lora(req.lora_int_id)
        return f"Success: LoRA adapter '{name}' removed successfully."

    @staticmethod
    def _fields(body: Any, path_field: str | None) -> tuple[str, str]:
        if not isinstance(body, dict):
            raise APIError("the body must be a JSON object", 400)
        name, path = body.get("lora_name"), body.get(path_field) if path_field else ""
        if not isinstance(name, str) or not name or (path_field and (not isinstance(path, str) or not path)):
            need = "Both 'lora_name' and 'lora_path' must be provided." if path_field else "'lora_name' must be provided."
            raise APIError(need, 400, "lora_name" if not name else path_field)
        return name, path  # type: ignore[return-value]
