"""Llama, and the architectures that are Llama with a twist: Mistral (sliding window), Qwen2
(q/k/v bias), Qwen3 (per-head q/k norms). One decoder, configured from the Hugging Face config;
Gemma 3 (gemma3.py) reuses its parts.

Projections are fused at load time: q/k/v into `qkv_proj`, gate/up into `gate_up_proj`
(`packed_modules_mapping` tells the loader where each checkpoint tensor goes).
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from armserve import kernels
from armserve.layers.activation import get_act_and_mul
from armserve.layers.attention import Attention, key_channel_rms
from armserve.layers.quantized_linear import QuantizedLinear, QuantizedTensor, quantize_weight_int8
from armserve.layers.layernorm import RMSNorm
from armserve.layers.rotary_embedding import RotaryEmbedding, rope_parameters


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class Linear(nn.Module):
    """A plain linear layer whose weight may be filled shard by shard (fused projections).

    After loading, `finalize()` prepacks a bfloat16 or float32 weight for the dense GEMM kernel
    (every row count, decode to prefill) and drops the row-major copy; float16 keeps the skinny
    decode kernel and PyTorch's GEMM.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = _param(out_features, in_features)
        self.bias = _param(out_features) if bias else None
        self.packed: torch.Tensor | None = None

    def finalize(self) -> None:
        """Repack the weight into the kernel layout once (process_weights_after_loading)."""
        if kernels.use_kernel("dense_pack", self.weight):
            pack = kernels.pack_f32 if self.weight.dtype == torch.float32 else kernels.pack_bf16
            self.packed = pack(self.weight.data)
            self.weight = None  # the packed copy is the weight now

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        if self.packed is not None:
            out = kernels.dense(x, self.packed, self.out_features, self.in_features, out_dtype)
            if self.bias is not None:
                out = kernels.add_bias(out, self.bias) if kernels.use_kernel("small", out) else out.add_(self.bias)
            return out
        # Decode: a few tokens against 16-bit weights is memory-bound, where the kernel streams
        # the weight near copy speed and PyTorch's bf16 GEMM does not.
        if kernels.use_kernel("gemv", x):
            out = kernels.gemv(x, self.weight)
            out = out if self.bias is None else kernels.add_bias(out, self.bias)
        else:
            out = F.linear(x, self.weight, self.bias)
        return out if out_dtype is None else out.to(out_dtype)


def layer_sliding_windows(config) -> list[int | None]:
    """Sliding window of each layer: `layer_types` where given (Qwen2, Gemma), else Mistral's
    global `sliding_window`."""
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types:
        return [window if t == "sliding_attention" else None for t in types]
    return [window] * n


class VocabEmbedding(nn.Module):
    """Token embedding table (left uninitialised until the checkpoint fills it)."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = _param(vocab_size, hidden_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if kernels.use_kernel("embedding", self.weight) and input_ids.dim() == 1:
            return kernels.embedding(input_ids, self.weight)
        return F.embedding(input_ids, self.weight)


class LlamaAttention(nn.Module):
    """q/k/v from one fused projection, RoPE, paged attention, the output projection; with
    `qk_norm`, an RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3; `norm_offset` 1
    for Gemma's (1 + w) weights). `rope` and `scale` override the config's (Gemma 3's local layers
    and its query_pre_attn_scalar)."""

    def __init__(self, config, sliding_window: int | None, bias: bool, qk_norm: bool = False,
                 norm_offset: float = 0.0, rope: dict | None = None, scale: float | None = None) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=getattr(config, "o_bias", False))
        self.rotary_emb = RotaryEmbedding(
            self.head_dim, config.max_position_embeddings, rope or rope_parameters(config)
        )
        self.attn = Attention(
            self.num_heads, self.head_dim, scale or self.head_dim**-0.5, self.num_kv_heads, sliding_window
        )
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, norm_offset) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, norm_offset) if qk_norm else None

    def set_key_channel_rms(self, w_k: torch.Tensor, norm: RMSNorm) -> None:
        """Estimate the key channels' RMS for int8-cache smoothing (Attention.enable_key_smoothing),
        shared within each rotary pair (c, c + rot/2 in the neox layout every model here uses) so
        that scaling a pair commutes with the rotation."""
        if not self.rotary_emb.is_neox_style:
            return  # no smoothing: the pairing below is the neox one
        if self.k_norm is not None:
            # normalised keys: each head's channels have mean square 1 before the norm's weight
            w = (self.k_norm.weight.data.float() + self.k_norm.offset).abs()
            rms = w.expand(self.num_kv_heads, self.head_dim)
        else:
            b = self.qkv_proj.bias
            b_k = None if b is None else b.data[self.q_size:self.q_size + self.kv_size]
            rms = key_channel_rms(w_k, b_k, norm.weight.data + norm.offset).view(self.num_kv_heads, self.head_dim)
        half = self.rotary_emb.rotary_dim // 2
        pair = ((rms[:, :half].pow(2) + rms[:, half:2 * half].pow(2)) / 2).sqrt()
        self.attn.key_channel_rms = torch.cat([pair, pair, rms[:, 2 * half:]], dim=1).reshape(-1)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:  # in place on the heads inside qkv
            self.q_norm.forward_heads_(q.view(q.shape[0], self.num_heads, self.head_dim))
            self.k_norm.forward_heads_(k.view(k.shape[0], self.num_kv_heads, self.head_dim))
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class LlamaMLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up as one projection; `intermediate_size` overrides
    the config's (an MoE expert's or shared expert's width)."""

    def __init__(self, config, intermediate_size: int | None = None) -> None:
        super().__init__()
        inter = intermediate_size or config.intermediate_size
        bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = Linear(config.hidden_size, 2 * inter, bias=bias)
        self.down_proj = Linear(inter, config.hidden_size, bias=bias)
        # (Gemma names it hidden_activation)
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
        self.act = get_act_and_mul(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, sliding_window: int | None, qkv_bias: bool, qk_norm: bool = False) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.self_attn = LlamaAttention(config, sliding_window, qkv_bias, qk_norm)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.mlp = LlamaMLP(config)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.input_layernorm.start_or_add(x, residual)
        x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM: `forward(input_ids, positions) -> hidden`, then `compute_logits`."""

    # checkpoint name part -> (fused parameter name part, shard)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    qkv_bias = False
    qk_norm = False
    # GGUF tensor name (after `blk.N.`) -> this family's name, where it differs from Llama's
    # (model_loader.GGUF_BLOCK_NAMES); llama.cpp stores Llama's q/k rows permuted for its rotary.
    gguf_block_names: dict[str, str] = {}
    gguf_permuted_qk = True

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = self.make_layers(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = None if self.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size)
        self.tied_head: Linear | None = None  # a packed copy of the tied table (process_weights_after_loading)

    def make_layers(self, config) -> nn.ModuleList:
        windows = layer_sliding_windows(config)
        return nn.ModuleList(
            LlamaDecoderLayer(config, windows[i], self.qkv_bias, self.qk_norm) for i in range(config.num_hidden_layers)
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [rows, vocab] (the dense kernel writes them unrounded from its fp32 sums)."""
        head = self.lm_head if self.lm_head is not None else self.tied_head
        if getattr(head, "packed", None) is not None:
            return head(hidden, torch.float32)
        if self.lm_head is None:  # tied to the embedding table (not packed: not bfloat16, or no kernels)
            w = self.embed_tokens.weight
            if kernels.use_kernel("gemv", hidden):
                return kernels.cast(kernels.gemv(hidden, w), torch.float32)
            return F.linear(hidden, w).float()
        logits = self.lm_head(hidden)
        # the kernels' cast: a decode step then stays kernel calls only (engine/step_graph.py)
        return kernels.cast(logits, torch.float32) if kernels.use_kernel("small", logits) else logits.float()

    def process_weights_after_loading(self) -> None:
        """Prepack every bfloat16 / float32 dense weight for the GEMM kernel, once. A head tied
        to the embedding table gets a packed copy of it (the lookup keeps the row-major table):
        vocab x hidden x 2 (4) more bytes, for the head's speed at every batch size."""
        for m in self.modules():
            if isinstance(m, Linear):
                m.finalize()
        if self.lm_head is None and kernels.use_kernel("dense_pack", self.embed_tokens.weight):
            vocab, hidden = self.embed_tokens.weight.shape
            head = Linear(hidden, vocab)
            head.weight = nn.Parameter(self.embed_tokens.weight.data, requires_grad=False)
            head.finalize()
            object.__setattr__(self, "tied_head", head)  # not a submodule: its weight is the table's

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.layers]

    # ---- weights ---------------------------------------------------------------------------

    def _checkpoint_name(self, name: str) -> str:
        """Map a Hugging Face tensor name onto this module's names."""
        if name.startswith("model."):
            name = name[len("model."):]
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedTensor]]) -> set[str]:
        """Copy checkpoint tensors into the (fused) parameters; returns the parameter names filled.

        A `QuantizedTensor` turns its target Linear into a QuantizedLinear on first sight.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        key_weights: dict[int, torch.Tensor | QuantizedTensor] = {}  # layer -> its k_proj weight
        for raw_name, tensor in weights:
            name = self._checkpoint_name(raw_name)
            if "rotary_emb.inv_freq" in name:
                continue
            if name.endswith(".k_proj.weight") and name.startswith("layers."):
                key_weights[int(name.split(".")[1])] = tensor
            if isinstance(tensor, QuantizedTensor):
                target, shard = self._fused_target(name)
                if name == "lm_head.weight" and self.lm_head is None:
                    # tied lm_head from a quantized embedding table: use it as a quantized GEMM
                    self.lm_head = QuantizedLinear(tensor.shape[1], tensor.shape[0], False, [("all", tensor.shape[0])])
                module = self._quantized_module(target.rsplit(".", 1)[0], loaded)
                module.load_shard("all" if shard is None else shard, tensor)
                params = dict(self.named_parameters())  # the swap replaced parameters
                loaded.add(target if shard is None else f"{target}#{shard}")
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: some checkpoints store a copy anyway
            target, shard = self._fused_target(name)
            owner = self._module_of(target)
            if isinstance(owner, QuantizedLinear) and target.endswith(".weight"):
                # a float shard of a layer whose other shards are quantized
                owner.load_shard("all" if shard is None else shard, quantize_weight_int8(tensor))
                loaded.add(target if shard is None else f"{target}#{shard}")
                continue
            for part, (fused, shard) in self.packed_modules_mapping.items():
                if f".{part}." in name:
                    target = name.replace(f".{part}.", f".{fused}.")
                    param = params[target]
                    self._load_shard(target, param, tensor, shard)
                    loaded.add(f"{target}#{shard}")
                    break
            else:
                if name not in params:
                    continue  # unknown extra tensors are ignored, like transformers does
                param = params[name]
                if param.shape != tensor.shape:
                    raise ValueError(
                        f"weight {raw_name} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
                    )
                param.data.copy_(tensor)
                loaded.add(name)
        for i, w_k in key_weights.items():
            w = w_k.dequantize() if isinstance(w_k, QuantizedTensor) else w_k
            self.layers[i].self_attn.set_key_channel_rms(w, self.layers[i].input_layernorm)
        return loaded

    def _fused_target(self, name: str) -> tuple[str, object]:
        for part, (fused, shard) in self.packed_modules_mapping.items():
            if f".{part}." in name:
                return name.replace(f".{part}.", f".{fused}."), shard
        return name, None

    def _module_of(self, target: str):
        path = target.rsplit(".", 1)[0]
        try:
            return self.get_submodule(path)
        except AttributeError:
            return None

    def _quantized_module(self, path: str, loaded: set[str] | None = None) -> QuantizedLinear:
        """The QuantizedLinear at `path`, swapped in for the float Linear there if needed (float
        shards loaded into the Linear before the swap are carried over as int8)."""
        parent_path, _, attr = path.rpartition(".")
        parent = self.get_submodule(parent_path) if parent_path else self
        current = getattr(parent, attr)
        if isinstance(current, QuantizedLinear):
            return current
        out_f, in_f = current.weight.shape
        if attr == "qkv_proj":
            a = parent
            shards = [("q", a.q_size), ("k", a.kv_size), ("v", a.kv_size)]
        elif attr == "gate_up_proj":
            shards = [(0, out_f // 2), (1, out_f // 2)]
        else:
            shards = [("all", out_f)]
        q = QuantizedLinear(in_f, out_f, current.bias is not None, shards)
        if current.bias is not None:
            q.bias.data.copy_(current.bias.data)  # a float bias may have been loaded already
        row = 0
        for shard, rows in shards:
            name = f"{path}.weight" if shard == "all" else f"{path}.weight#{shard}"
            if loaded is not None and name in loaded:
                q.load_shard(shard, quantize_weight_int8(current.weight.data[row:row + rows]))
            row += rows
        setattr(parent, attr, q)
        return q

    def _load_shard(self, target: str, param: torch.Tensor, tensor: torch.Tensor, shard) -> None:
        if "qkv_proj" in target:
            attn = self.layers[int(target.split(".")[1])].self_attn
            q, kv = attn.q_size, attn.kv_size
            start, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard]
        else:
            size = param.shape[0] // 2
            start = shard * size
        dst = param.data.narrow(0, start, size)
        if dst.shape != tensor.shape:
            raise ValueError(f"weight for {target}[{shard}] has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
        dst.copy_(tensor)

    def expected_weights(self) -> set[str]:
        """The names `load_weights` must report for a complete checkpoint."""
        out: set[str] = set()
        for name, _ in self.named_parameters():
            if ".qkv_proj." in name:
                out |= {f"{name}#q", f"{name}#k", f"{name}#v"}
            elif ".gate_up_proj." in name:
                out |= {f"{name}#0", f"{name}#1"}
            else:
                out.add(name)
        return out


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama with a sliding attention window (from `config.sliding_window`)."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: Llama with biases on the q/k/v projections."""

    qkv_bias = True
    gguf_permuted_qk = False


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: Llama with an RMSNorm over each head of q and k (before RoPE), no q/k/v bias unless
    the config's attention_bias, and head_dim from the config."""

    qk_norm = True
    gguf_block_names = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
    gguf_permuted_qk = False

    def __init__(self, config) -> None:
        self.qkv_bias = bool(getattr(config, "attention_bias", False))
        super().__init__(config)
