"""LoRARequest: the adapter one request runs with (vLLM's `vllm.lora.request.LoRARequest`)."""

from __future__ import annotations

from dataclasses import dataclass


class LoRAError(ValueError):
    """An adapter cannot be loaded or run on this base model; the message names the adapter and why."""


@dataclass(frozen=True)
class LoRARequest:
    """An adapter: `lora_name` (what a server's `model` field names it), `lora_int_id` (a positive
    id unique per adapter: the KV cache and the adapter caches key on it) and `lora_path` (a PEFT
    folder: adapter_config.json + adapter_model.safetensors, or a llama.cpp GGUF LoRA file).
    Positional `(name, id, path)` works.
    `base_model_name`: the model it was trained on, as `/v1/models` reports it (optional)."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest.lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"LoRARequest.lora_path must be a non-empty string, got {self.lora_path!r}")
