"""DeepSeek-V3's multi-token prediction (MTP) layer as a draft head (`speculative_config`
method "mtp"; vLLM's `deepseek_mtp.py` reads the same tensors). A DeepSeek-V3 checkpoint with
`num_nextn_predict_layers` holds it after the model's own layers, as layer num_hidden_layers:

    e = enorm(embed(token))   (zeros at position 0)     h = hnorm(target's final hidden state)
    x = eh_proj(cat(e, h))  ->  one DeepSeek decoder layer (MLA, MoE)  ->  shared_head.norm
      -> shared_head.head: logits over the target's vocabulary

Like an EAGLE head (engine/eagle_proposer.py runs both), position p pairs the target's hidden
state at p with the token at p + 1; later draft steps feed back the layer's own normed output.
Names under `model.layers.N.`: `enorm`, `hnorm`, `eh_proj`, `shared_head.{norm,head}`,
`embed_tokens` (absent: the target's table), and the decoder layer's own tensors. Only the first
of several MTP layers is used (DeepSeek-V3 has one).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from armserve.layers.layernorm import RMSNorm
from armserve.layers.linear import Linear
from armserve.models.deepseek import DeepseekAttention, DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from armserve.models.llama import LlamaDecoderLayer


class DeepseekMTP(DeepseekV2ForCausalLM):
    """One MTP layer: `combine(aux)` is the target's final norm of its last residual stream,
    `forward(ids, positions, hidden)` returns (normed rows for `draft_token_ids`, rows fed back)."""

    def __init__(self, config, index: int, v3: bool, target) -> None:
        object.__setattr__(self, "_index", index)  # (read by make_layers, before nn.Module is set up)
        object.__setattr__(self, "v3", v3)
        super().__init__(config)
        h = config.hidden_size
        self.enorm = RMSNorm(h, config.rms_norm_eps)
        self.hnorm = RMSNorm(h, config.rms_norm_eps)
        self.eh_proj = Linear(2 * h, h)
        object.__setattr__(self, "target", target)  # (not a submodule: its norm and, maybe, its embeddings)
        self.shared_embed = False  # True: the checkpoint has no MTP embedding table (the target's serves)

    def make_layers(self, config) -> nn.ModuleList:
        interleave = bool(getattr(config, "rope_interleave", True))
        return nn.ModuleList([LlamaDecoderLayer(config, DeepseekAttention(config, interleave),
                                                self.make_mlp(config, self._index))])

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        return self.target.norm(aux)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,  # type: ignore[override]
                hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        e = (self.target if self.shared_embed else self).embed_tokens(input_ids)
        e = e.masked_fill((positions == 0).unsqueeze(-1), 0)  # (the first token has no hidden state before it)
        x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(hidden)], dim=-1))
        x, residual = self.layers[0](positions, x, None)
        normed, _ = self.norm(x, residual)
        return normed, normed  # (vLLM and SGLang feed the normed output back)

    def draft_token_ids(self, normed: torch.Tensor) -> list[int]:
        from armserve import kernels

        return kernels.argmax(self._local_logits(normed).contiguous()).tolist()

    def mtp_name(self, name: str) -> str | None:
        """A checkpoint name of MTP layer `_index` as this module's, None for any other tensor."""
        prefix = f"model.layers.{self._index}."
        if not name.startswith(prefix):
            return None
        rest = name[len(prefix):]
        for old, new in (("shared_head.norm.", "norm."), ("shared_head.head.", "lm_head.")):
            if rest.startswith(old):
                return new + rest[len(old):]
        if rest.startswith(("enorm.", "hnorm.", "eh_proj.", "embed_tokens.")):
            return rest
        return "layers.0." + rest

    def process_weights_after_loading(self) -> None:
        if self.shared_embed:
            self.embed_tokens = None  # type: ignore[assignment]  (never loaded: the target's serves)
        super().process_weights_after_loading()

    def _quantized_embedding(self) -> None:
        if not self.shared_embed:
            super()._quantized_embedding()


def load_mtp_layer(path: str, target: nn.Module, target_config, dtype: torch.dtype) -> tuple[DeepseekMTP, object]:
    """(the MTP layer, a config of it for the KV cache) from the checkpoint at `path` (the target's,
    as vLLM reads it); the target is set to keep its last hidden states. A ConfigError names a
    target or checkpoint without a usable MTP layer."""
    from armserve import model_loader
    from armserve.config import ConfigError

    def fail(msg: str) -> ConfigError:
        return ConfigError(f"speculative_config: method 'mtp': {msg}")

    if not isinstance(target, DeepseekV2ForCausalLM):
        raise fail(f"the target is a {type(target).__name__}; MTP layers are read for DeepSeek-V3 models")
    n_mtp = int(getattr(target_config, "num_nextn_predict_layers", 0) or 0)
    if n_mtp < 1:
        raise fail("the target's config has no num_nextn_predict_layers (its checkpoint holds no MTP layer)")
    try:
        src = model_loader.resolve_model_path(path)
    except model_loader.ModelLoadError as e:
        raise fail(str(e)) from None
    if src.is_gguf:
        raise fail(f"{path} is a GGUF file; MTP layers are read from Hugging Face checkpoints")
    n = target_config.num_hidden_layers
    target.set_aux_hidden_layers((n,))  # (the last layer's output: `combine` applies the final norm)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        mtp = DeepseekMTP(target_config, n, isinstance(target, DeepseekV3ForCausalLM), target)
        weights = ((m, t) for name, t in model_loader.checkpoint_weights(src, target_config)
                   if (m := mtp.mtp_name(name)) is not None)
        try:
            loaded = mtp.load_weights(weights)
        except ValueError as e:
            raise fail(f"layer {n} of {path}: {e}") from None
    finally:
        torch.set_default_dtype(prev)
    expected = mtp.expected_weights()
    if "embed_tokens.weight" not in loaded:
        mtp.shared_embed = True
        expected.discard("embed_tokens.weight")
    missing = expected - loaded
    if missing:
        shown = ", ".join(f"model.layers.{n}.{m}" for m in sorted(missing)[:4])
        raise fail(f"{path} is missing {len(missing)} tensor(s) of MTP layer {n}, e.g. {shown}")
    mtp.process_weights_after_loading()
    mtp.eval()
    config = copy.copy(target_config)
    config.num_hidden_layers = 1  # (its KV cache: one layer)
    return mtp, config
