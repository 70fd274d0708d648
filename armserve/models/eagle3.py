"""EAGLE-3 draft heads (arXiv:2503.01840; vLLM's `llama_eagle3.py` checkpoint format), the model
that `speculative_config` method "eagle3" loads from `model` (engine/eagle_proposer.py runs it).

A head is one Llama decoder layer (or a few) fed by the target itself:

    target aux hidden states of 3 layers (low, mid, high) --fc--> h [hidden]       (once per token)
    layer 0:  attention over cat(input_layernorm(embed(token)), hidden_norm(h))   (2 x hidden wide)
              + h as the residual, post-attention norm, MLP; later layers as Llama's
    norm(x + residual) -> lm_head over the draft vocabulary -> draft id + d2t[draft id] = target id

Position p of the head's sequence pairs the target's hidden state at p with the token at p + 1,
so it predicts the token at p + 2; each further draft step feeds back the head's own output
before the final norm in place of the target's. The head has its own KV cache (one layer).

Checkpoint names (SafeAILab's EAGLE and vLLM's): `midlayer.*` (layer 0) or `layers.N.*`, `fc`,
`norm`, `lm_head` [draft_vocab_size, hidden], `d2t` [draft_vocab_size] (draft -> target id
offsets; absent when the draft vocabulary is the target's), `t2d` [vocab_size] (bool, which
target ids the draft vocabulary holds), `embed_tokens` (absent: the target's table is shared).
Config: `draft_vocab_size`, `target_hidden_size`, `eagle_config.eagle_aux_hidden_state_layer_ids`
(default: layers 2, n // 2 and n - 3 of an n-layer target), `norm_before_residual`,
`norm_before_fc`, `fc_norm`, `norm_output`. The `speculators` format (RedHat's; config.json with
`speculators_model_type` "eagle3" and `transformer_layer_config`) loads as vLLM reads it.
"""

from __future__ import annotations

import torch
from torch import nn

from armserve import kernels
from armserve.layers.layernorm import RMSNorm
from armserve.layers.linear import Linear, ParallelLMHead, QKVParallelLinear, VocabEmbedding
from armserve.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


def eagle_option(config, key: str, default=None):
    """A head option from the config's `eagle_config` dict, else the config itself (checkpoints
    put them in either place)."""
    eagle = getattr(config, "eagle_config", None) or {}
    if isinstance(eagle, dict) and key in eagle:
        return eagle[key]
    return getattr(config, key, default)


def aux_layer_ids(head_config, target_layers: int) -> tuple[int, ...]:
    """The target layers whose input the head fuses: the config's, else vLLM's default choice."""
    ids = eagle_option(head_config, "eagle_aux_hidden_state_layer_ids")
    if ids:
        return tuple(ids)
    return (2, target_layers // 2, target_layers - 3)


class _HeadAttention(LlamaAttention):
    """Layer 0's attention: q/k/v read the concatenated token and hidden halves (2 x hidden)."""

    def __init__(self, config, bias: bool) -> None:
        super().__init__(config, None, bias)
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        self.qkv_proj = QKVParallelLinear(2 * config.hidden_size, self.head_dim, heads, kv_heads, bias=bias)

    def set_key_channel_rms(self, w_k: torch.Tensor, norm: RMSNorm) -> None:
        pass  # (no int8-cache key smoothing: the input is two differently normed halves)


class Eagle3DecoderLayer(LlamaDecoderLayer):
    """Layer 0 takes (embeds, fused hidden); later layers are Llama's, on the hidden state alone."""

    def __init__(self, config, first: bool) -> None:
        bias = bool(getattr(config, "attention_bias", False))
        attn = _HeadAttention(config, bias) if first else LlamaAttention(config, None, bias)
        super().__init__(config, attn, LlamaMLP(config))
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if first else None
        self.norm_before_residual = bool(eagle_option(config, "norm_before_residual", False))

    def forward(self, positions: torch.Tensor, embeds: torch.Tensor, x: torch.Tensor,  # type: ignore[override]
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.hidden_norm is None:
            return super().forward(positions, x, residual)
        e = self.input_layernorm(embeds)
        h = self.hidden_norm(x)
        # NOTE: the post-attention norm adds into `residual` in place: `x` is the caller's to give up
        residual = h if self.norm_before_residual else x
        x = self.self_attn(positions, torch.cat([e, h], dim=-1))
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Eagle3Head(LlamaForCausalLM):
    """The head: `combine(aux)` fuses the target's hidden states, `forward(ids, positions, hidden)`
    returns (normed rows for `draft_token_ids`, the rows fed back as the next step's hidden)."""

    def __init__(self, config, target_hidden: int, own_embeddings: bool) -> None:  # noqa: super().__init__ skipped
        nn.Module.__init__(self)
        from armserve.layers.linear import get_parallel_context

        self.tp = get_parallel_context()
        self.config = config
        h = config.hidden_size
        self.embed_tokens = VocabEmbedding(config.vocab_size, h) if own_embeddings else None
        self.layers = nn.ModuleList(Eagle3DecoderLayer(config, i == 0) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.tie_word_embeddings = False
        self.draft_vocab_size = int(getattr(config, "draft_vocab_size", None) or config.vocab_size)
        self.lm_head = ParallelLMHead(h, self.draft_vocab_size)
        self.tied_head = None
        self.num_aux = len(eagle_option(config, "eagle_aux_hidden_state_layer_ids") or ()) or int(
            getattr(config, "num_aux_hidden_states", None) or 3)
        fc_in = target_hidden * self.num_aux
        self.input_norm = RMSNorm(fc_in, config.rms_norm_eps) if eagle_option(config, "norm_before_fc", False) else None
        self.fc_norm = nn.ModuleList(RMSNorm(target_hidden, config.rms_norm_eps) for _ in range(self.num_aux)) if (
            getattr(config, "fc_norm", False)) else None
        self.fc = Linear(fc_in, h)
        self.norm_output = bool(getattr(config, "norm_output", False))
        # draft id -> target id (d2t offsets added at load); None: the same vocabulary
        self.register_buffer("draft_to_target", None, persistent=False)
        self.shared_embed: VocabEmbedding | None = None  # the target's table, when the head has none

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """fc over the target's hidden states of its aux layers, concatenated [rows, n x hidden]."""
        if self.input_norm is not None:
            aux = self.input_norm(aux)
        if self.fc_norm is not None:
            aux = torch.cat([n(c.contiguous()) for n, c in zip(self.fc_norm, aux.chunk(self.num_aux, dim=-1))], dim=-1)
        return self.fc(aux)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,  # type: ignore[override]
                hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        embed = self.embed_tokens if self.embed_tokens is not None else self.shared_embed
        embeds = embed(input_ids)  # type: ignore[misc]
        x, residual = hidden, None
        for layer in self.layers:
            x, residual = layer(positions, embeds, x, residual)
        normed, prenorm = self.norm(x, residual)
        return normed, (normed if self.norm_output else prenorm)

    def draft_token_ids(self, normed: torch.Tensor) -> list[int]:
        """The head's argmax of each row, as target token ids."""
        ids = kernels.argmax(self._local_logits(normed).contiguous())
        if self.draft_to_target is not None:
            ids = self.draft_to_target.index_select(0, ids)
        return ids.tolist()

    def attention_layers(self):
        return [layer.self_attn.attn for layer in self.layers]

    def _checkpoint_name(self, name: str) -> str:
        name = super()._checkpoint_name(name)
        return "layers.0." + name[len("midlayer."):] if name.startswith("midlayer.") else name

    def process_weights_after_loading(self) -> None:
        for m in self.modules():
            if isinstance(m, Linear):
                m.finalize()


def load_eagle3_head(path: str, target: nn.Module, target_config, dtype: torch.dtype) -> tuple[Eagle3Head, object]:
    """(the head, its config) from the checkpoint folder `path`, checked against the target; the
    target is set to keep the hidden states the head fuses. A ConfigError names what does not fit:
    the architecture, hidden or vocabulary sizes, the aux layers, a missing or misshapen tensor,
    or a d2t / t2d vocabulary mapping that is not one-to-one into the target's vocabulary."""
    from armserve import model_loader
    from armserve.config import ConfigError

    def fail(msg: str) -> ConfigError:
        return ConfigError(f"speculative_config: the EAGLE-3 head {path!r} {msg}")

    try:
        src = model_loader.resolve_model_path(path)
        config = _speculators_config(src.folder) or model_loader.load_config(src)
    except model_loader.ModelLoadError as e:
        raise fail(f"cannot be read: {e}") from None
    if config.architectures[0] not in ARCHITECTURES:
        raise fail(f"is a {config.architectures[0]}, not an EAGLE-3 head ({', '.join(ARCHITECTURES)})")
    t_hidden, t_vocab = target_config.hidden_size, target_config.vocab_size
    if int(getattr(config, "target_hidden_size", None) or config.hidden_size) != t_hidden:
        raise fail(f"reads hidden states of size {getattr(config, 'target_hidden_size', None) or config.hidden_size}, "
                   f"the target's are {t_hidden}")
    if config.vocab_size != t_vocab:
        raise fail(f"has a vocabulary of {config.vocab_size} tokens, the target {t_vocab}")
    weights = dict(model_loader.checkpoint_weights(src, config, dequantize=True))
    own_embed = any(n.endswith("embed_tokens.weight") for n in weights)
    if not own_embed and config.hidden_size != t_hidden:
        raise fail(f"has hidden size {config.hidden_size} and no embed_tokens of its own; the target's are "
                   f"{t_hidden} wide")
    ids = aux_layer_ids(config, target_config.num_hidden_layers)
    try:
        target.set_aux_hidden_layers(ids)
    except (ValueError, AttributeError) as e:
        raise fail(f"cannot draft for this target: {e}" + (
            "" if eagle_option(config, "eagle_aux_hidden_state_layer_ids") else
            " (the default aux layers; set eagle_config.eagle_aux_hidden_state_layer_ids)")) from None
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        head = Eagle3Head(config, t_hidden, own_embed)
        if head.num_aux != len(ids):
            raise fail(f"fuses {head.num_aux} hidden states but names {len(ids)} aux layers")
        d2t, t2d = weights.pop("d2t", None), weights.pop("t2d", None)
        try:
            loaded = head.load_weights(weights.items())
        except ValueError as e:
            raise fail(str(e)) from None
    finally:
        torch.set_default_dtype(prev)
    missing = head.expected_weights() - loaded
    if missing:
        raise fail(f"is missing {len(missing)} tensor(s): {', '.join(sorted(missing)[:5])}")
    if head.draft_vocab_size != t_vocab or d2t is not None:
        head.draft_to_target = _vocabulary_map(head.draft_vocab_size, t_vocab, d2t, t2d, fail)
    head.process_weights_after_loading()
    if not own_embed:
        object.__setattr__(head, "shared_embed", target.embed_tokens)  # (not a submodule: the target's)
    head.eval()
    return head, config


def _speculators_config(folder: str):
    """The head config of a checkpoint in the `speculators` format (config.json with
    `speculators_model_type` "eagle3" and the layer's config in `transformer_layer_config`), as
    vLLM reads it: its eagle keys over the layer's Llama config; None for other folders."""
    import json
    import os

    from transformers import LlamaConfig

    try:
        with open(os.path.join(folder, "config.json")) as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return None  # (load_config names the problem)
    if not isinstance(raw, dict) or "speculators_model_type" not in raw:
        return None
    from armserve.config import ConfigError

    layer = raw.get("transformer_layer_config")
    layer_type = layer.get("model_type", "llama") if isinstance(layer, dict) else None
    if raw["speculators_model_type"] != "eagle3" or layer_type != "llama":
        raise ConfigError(f"speculative_config: {folder} is a speculators checkpoint of type "
                          f"{raw['speculators_model_type']!r} over a {layer_type!r} layer; an EAGLE-3 head over "
                          "a Llama layer is what loads")
    keys = {k: raw[k] for k in ("draft_vocab_size", "target_hidden_size", "norm_before_fc", "fc_norm", "norm_output",
                                "eagle_aux_hidden_state_layer_ids") if raw.get(k) is not None}
    fields = {k: v for k, v in layer.items() if k not in ("architectures", "model_type")}
    return LlamaConfig(**{**fields, **keys, "norm_before_residual": raw.get("norm_before_residual", True),
                          "architectures": [ARCHITECTURES[1]]})


def _vocabulary_map(draft_vocab: int, vocab: int, d2t, t2d, fail) -> torch.Tensor:
    """Draft id -> target id from `d2t` offsets, checked: one-to-one into [0, vocab), and matching
    `t2d` (the target ids it marks) when the checkpoint has one."""
    if d2t is None:
        raise fail(f"has a draft vocabulary of {draft_vocab} tokens (the target's: {vocab}) but no d2t mapping")
    if tuple(d2t.shape) != (draft_vocab,) or d2t.is_floating_point():
        raise fail(f"d2t must be {draft_vocab} integers (draft_vocab_size), got {d2t.dtype} {tuple(d2t.shape)}")
    targets = torch.arange(draft_vocab, dtype=torch.long) + d2t.long()
    if targets.min() < 0 or targets.max() >= vocab:
        raise fail(f"d2t maps draft ids outside the target's vocabulary of {vocab} tokens")
    if targets.unique().numel() != draft_vocab:
        raise fail("d2t maps two draft ids to the same target id")
    if t2d is not None:
        if tuple(t2d.shape) != (vocab,):
            raise fail(f"t2d must have one entry per target token ({vocab}), got {tuple(t2d.shape)}")
        marked = t2d.bool()
        if int(marked.sum()) != draft_vocab or not bool(marked[targets].all()):
            raise fail("t2d does not mark exactly the target ids d2t maps to")
    return targets
