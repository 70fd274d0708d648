"""Llama, and the architectures that are Llama with a twist: Mistral (sliding window), Qwen2
(q/k/v bias), Qwen3 (per-head q/k norms). One decoder, configured from the Hugging Face config;
Gemma 3 (gemma3.py) reuses its parts.

Projections are fused at load time: q/k/v into `qkv_proj`, gate/up into `gate_up_proj`
(`packed_modules_mapping` tells the loader where each checkpoint tensor goes).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from armserve import kernels
from armserve.layers.activation import get_act_and_mul
from armserve.layers.attention import Attention, key_channel_rms
from armserve.layers.layernorm import RMSNorm
from armserve.layers.linear import (ColumnParallelLinear, Linear, ParallelLMHead, QKVParallelLinear, RowParallelLinear,
                                    VocabEmbedding, get_parallel_context, parallel_context)
from armserve.layers.rotary_embedding import RotaryEmbedding, rope_parameters
from armserve.models.adapters import as_pooling_model
from armserve.quantization import QuantizedLinear, QuantizedTensor, quantize_weight_int8
from armserve.quantization.embedding import MappedEmbedding, QuantizedEmbedding
from armserve.quantization.gguf import GGUFRows


def layer_sliding_windows(config) -> list[int | None]:
    """Sliding window of each layer: `layer_types` where given (Qwen2, Gemma), else Mistral's
    global `sliding_window`."""
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types:
        return [window if t == "sliding_attention" else None for t in types]
    return [window] * n


def copy_rows(x: torch.Tensor) -> torch.Tensor:
    """A copy of x that a decode step's recording can replay (the kernels' cast on a few rows;
    PyTorch's clone beyond, where steps are not recorded)."""
    if kernels.use_kernel("small", x):
        return kernels.cast(x, x.dtype)
    return x.clone()


def _copy_whole(param: torch.Tensor, tensor: torch.Tensor) -> None:
    """A parameter no layer splits (norms, router biases): the checkpoint tensor as it is."""
    if param.shape != tensor.shape:
        raise ValueError(f"has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
    param.data.copy_(tensor)


class LlamaAttention(nn.Module):
    """q/k/v from one fused projection, RoPE, paged attention, the output projection; with
    `qk_norm`, an RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3; `norm_offset` 1
    for Gemma's (1 + w) weights). `rope` and `scale` override the config's (Gemma 3's local layers
    and its query_pre_attn_scalar)."""

    def __init__(self, config, sliding_window: int | None, bias: bool, qk_norm: bool = False,
                 norm_offset: float = 0.0, rope: dict | None = None, scale: float | None = None) -> None:
        super().__init__()
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, heads, kv_heads, bias=bias)
        # (this tensor-parallel rank's heads: all of them on one rank)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(heads * self.head_dim, config.hidden_size,
                                        bias=getattr(config, "o_bias", False), input_cols=self.qkv_proj.q_cols)
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
        that scaling a pair commutes with the rotation. `w_k`: the checkpoint's whole k_proj weight."""
        if not self.rotary_emb.is_neox_style:
            return  # no smoothing: the pairing below is the neox one
        w_k = self.qkv_proj.split.take("k", w_k)  # this rank's KV heads
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
    the config's (an MoE expert's or shared expert's width); `reduce=False` leaves the sum over
    tensor-parallel ranks to the caller (an MoE block's experts)."""

    def __init__(self, config, intermediate_size: int | None = None, reduce: bool = True) -> None:
        super().__init__()
        inter = intermediate_size or config.intermediate_size
        bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [inter, inter], bias=bias)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=bias, reduce=reduce)
        # (Gemma names it hidden_activation)
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
        self.act = get_act_and_mul(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """The pre-norm residual block around an attention (Llama's, DeepSeek's MLA) and an MLP (dense or MoE)."""

    def __init__(self, config, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp
        # EAGLE-3 (engine/eagle_proposer.py): a copy of the residual stream entering this layer,
        # taken each forward while `keep_input` is set
        self.keep_input = False
        self.kept_input: torch.Tensor | None = None

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.input_layernorm.start_or_add(x, residual)
        if self.keep_input:  # (the norm's fused add left the layer's input in `residual`)
            self.kept_input = copy_rows(residual)
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
    qkv_bias: bool | None = False  # None: the config's attention_bias
    qk_norm = False

    # ---- what checkpoints call this class (models/__init__.py collects every family's MODELS) ----
    architectures: tuple[str, ...] = ("LlamaForCausalLM",)  # config.json `architectures`
    model_types: tuple[str, ...] = ("llama",)  # transformers `model_type` (GGUF configs name no architecture)
    gguf_architectures: tuple[str, ...] = ("llama",)  # llama.cpp `general.architecture`, read by gguf_config
    # GGUF layout: tensor name (after `blk.N.`) -> this family's name where it differs from
    # llama.cpp's standard names (model_loader/gguf.py); whether llama.cpp's converter permuted the
    # q/k rows for its rotary (undone at load); what it added to the norm weights.
    gguf_block_names: dict[str, str] = {}
    gguf_permuted_qk = True
    gguf_norm_offset = 0.0
    # False: no language-model head is built or loaded (the pooling models of models/adapters.py)
    has_lm_head = True

    @classmethod
    def gguf_config(cls, field: Callable[[str], Any], tensors: Mapping[str, Any], read: Callable[[], Any]):
        """The transformers config of a GGUF file of one of `gguf_architectures`: `read()` is
        transformers' own reading of its header, `field(key)` a header value (an array's length;
        None if absent), `tensors` the file's tensors by name. llama.cpp writes Mixtral as a
        `llama` file with an expert count, read here as a Mixtral config."""
        config = read()
        experts = field("llama.expert_count")
        if not experts or config.model_type != "llama":
            return config
        from transformers import MixtralConfig

        values = {k: v for k, v in config.to_dict().items() if k not in ("model_type", "architectures")}
        config = MixtralConfig(**values)
        config.num_local_experts, config.num_experts_per_tok = int(experts), int(field("llama.expert_used_count"))
        config.architectures = ["MixtralForCausalLM"]
        return config
    # Its layers split over tensor-parallel ranks (layers/linear.py), attention by heads, the MLP
    # (or each expert) by intermediate width.
    supports_tp = True

    def __init__(self, config) -> None:
        super().__init__()
        self.tp = get_parallel_context()
        if self.tp.world > 1 and not self.supports_tp:
            raise ValueError(f"{type(self).__name__} cannot be split for tensor parallelism: "
                             f"use tensor_parallel_size 1, not {self.tp.world}")
        self.config = config
        if self.qkv_bias is None:
            self.qkv_bias = bool(getattr(config, "attention_bias", False))
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = self.make_layers(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = None if self.tie_word_embeddings or not self.has_lm_head else ParallelLMHead(config.hidden_size, config.vocab_size)
        self.tied_head: Linear | None = None  # a packed copy of the tied table (process_weights_after_loading)

    def make_layers(self, config) -> nn.ModuleList:
        windows = layer_sliding_windows(config)
        return nn.ModuleList(
            LlamaDecoderLayer(config, LlamaAttention(config, windows[i], self.qkv_bias, self.qk_norm),
                              self.make_mlp(config, i)) for i in range(config.num_hidden_layers)
        )

    def make_mlp(self, config, i: int) -> nn.Module:
        """Layer i's MLP (a MoE family's sparse layers have experts)."""
        return LlamaMLP(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        x, residual = self.norm(x, residual)
        if self.aux_hidden_layers:
            self.aux_hidden = self._collect_aux(residual)
        return x

    # ---- EAGLE-3: hidden states of a few layers for the draft head (engine/eagle_proposer.py) ----

    aux_hidden_layers: tuple[int, ...] = ()
    aux_hidden: list[torch.Tensor] | None = None

    def set_aux_hidden_layers(self, layer_ids: tuple[int, ...]) -> None:
        """Make each forward keep the residual stream entering each of `layer_ids` (vLLM's
        numbering: 0 = the embeddings, num_hidden_layers = the last layer's output before the
        final norm) in `aux_hidden`, in that order. A ValueError names what this model cannot."""
        n = len(self.layers)
        bad = [i for i in layer_ids if not isinstance(i, int) or not 0 <= i <= n]
        if bad:
            raise ValueError(f"aux hidden state layer ids {bad} are outside this {n}-layer model's 0..{n}")
        if type(self).forward is not LlamaForCausalLM.forward or not all(
                isinstance(layer, LlamaDecoderLayer) for layer in self.layers):
            raise ValueError(f"{type(self).__name__} does not expose its hidden states to a draft head")
        for i, layer in enumerate(self.layers):
            layer.keep_input = i in layer_ids
        self.aux_hidden_layers = tuple(layer_ids)

    def _collect_aux(self, final: torch.Tensor) -> list[torch.Tensor]:
        n = len(self.layers)
        last = copy_rows(final) if n in self.aux_hidden_layers else None  # (the final norm's fused sum)
        return [last if i == n else self.layers[i].kept_input for i in self.aux_hidden_layers]  # type: ignore[misc]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """float32 logits [rows, vocab] (the dense kernel writes them unrounded from its fp32 sums);
        under tensor parallelism gathered on rank 0, None on the other ranks."""
        return self.tp.gather_logits(self._local_logits(hidden), self.config.vocab_size)

    def _local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.lm_head if self.lm_head is not None else self.tied_head
        if getattr(head, "packed", None) is not None:
            return head(hidden, torch.float32)
        if self.lm_head is None:  # tied to the embedding table (not packed: not bfloat16, or no kernels)
            w = self.embed_tokens.weight
            if kernels.use_kernel("gemv", hidden):
                return kernels.cast(kernels.gemv(hidden, w), torch.float32)
            return F.linear(hidden, w).float()
        # the kernels' cast on a decode step's rows: the step then stays kernel calls only (engine/step_graph.py)
        return kernels.cast(self.lm_head(hidden), torch.float32)

    def process_weights_after_loading(self) -> None:
        """Prepack every weight for its GEMM kernel, once: bfloat16 / float32 dense weights and the
        quantized layers' shards. A quantized embedding table stays quantized (a tied head's packed
        weight is its one copy). A head tied to a float table gets a packed copy of it (the lookup
        keeps the row-major table): vocab x hidden x 2 (4) more bytes, for the head's speed at
        every batch size."""
        for m in self.modules():
            if isinstance(m, (Linear, QuantizedLinear)):
                m.finalize()
        self._quantized_embedding()
        if self.lm_head is None and kernels.use_kernel("dense_pack", self.embed_tokens.weight):
            vocab, hidden = self.embed_tokens.weight.shape
            head = Linear(hidden, vocab)
            head.weight = nn.Parameter(self.embed_tokens.weight.data, requires_grad=False)
            head.finalize()
            object.__setattr__(self, "tied_head", head)  # not a submodule: its weight is the table's

    def _quantized_embedding(self) -> None:
        """A quantized embedding table loaded as such stays quantized; the tiles of a head tied to it
        (loaded first, and packed as soon as loaded: quantization/linear.py) serve its lookups too.
        An untied GGUF table stays in the file's memory map."""
        emb = self.embed_tokens
        if isinstance(emb.table, GGUFRows):  # read where the GGUF file is mapped (model_loader/gguf.py)
            emb.table = MappedEmbedding(emb.table, emb.dtype)
        if isinstance(emb.table, QuantizedTensor):
            head = self.lm_head if self.tie_word_embeddings and isinstance(self.lm_head, QuantizedLinear) else None
            emb.table = QuantizedEmbedding(emb.table, emb.dtype, head)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.layers]

    # ---- weights ---------------------------------------------------------------------------

    def _checkpoint_name(self, name: str) -> str:
        """Map a Hugging Face tensor name onto this module's names."""
        if name.startswith("model."):
            name = name[len("model."):]
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedTensor]]) -> set[str]:
        """Fill the (fused) parameters from checkpoint tensors, each through its layer's
        `weight_loader` (which keeps this tensor-parallel rank's part); returns the parameter
        names filled (`name#shard` for a shard of a fused one).

        A `QuantizedTensor` turns its target Linear into a QuantizedLinear on first sight.
        """
        loaded: set[str] = set()
        key_weights: dict[int, torch.Tensor | QuantizedTensor] = {}  # layer -> its k_proj weight
        for raw_name, tensor in weights:
            name = self._checkpoint_name(raw_name)
            if "rotary_emb.inv_freq" in name:
                continue
            if name.endswith(".k_proj.weight") and name.startswith("layers."):
                key_weights[int(name.split(".")[1])] = tensor
            quantized = isinstance(tensor, QuantizedTensor)
            if name == "lm_head.weight" and self.lm_head is None:
                if not quantized:
                    continue  # tied: some checkpoints store a copy anyway
                # tied lm_head from a quantized embedding table: use it as a quantized GEMM
                with parallel_context(self.tp):
                    self.lm_head = ParallelLMHead(self.config.hidden_size, self.config.vocab_size)
            target, shard = self._fused_target(name)
            path, _, attr = target.rpartition(".")
            try:
                module = self.get_submodule(path)
            except AttributeError:
                module = None
            if (quantized and not isinstance(module, VocabEmbedding)) or (isinstance(module, QuantizedLinear)
                                                                          and attr == "weight"):
                module = self._quantized_module(path, loaded)
            elif not isinstance(getattr(module, attr, None), nn.Parameter):
                continue  # unknown extra tensors are ignored, like transformers does (or a bias of rank 0's only)
            try:
                if hasattr(module, "weight_loader"):
                    module.weight_loader(attr, tensor, "all" if shard is None else shard)
                    if quantized and isinstance(module, VocabEmbedding):
                        self._quantized_embedding()  # packed now: the unpacked table never waits beside the rest
                else:
                    _copy_whole(getattr(module, attr), tensor)
            except ValueError as e:
                raise ValueError(f"weight {raw_name} {e}") from None
            loaded.add(target if shard is None else f"{target}#{shard}")
        for i, w_k in key_weights.items():
            w = w_k.dequantize() if isinstance(w_k, QuantizedTensor) else w_k
            self.layers[i].self_attn.set_key_channel_rms(w, self.layers[i].input_layernorm)
        return loaded

    def _fused_target(self, name: str) -> tuple[str, object]:
        for part, (fused, shard) in self.packed_modules_mapping.items():
            if f".{part}." in name:
                return name.replace(f".{part}.", f".{fused}."), shard
        return name, None

    def _quantized_module(self, path: str, loaded: set[str] | None = None) -> QuantizedLinear:
        """The QuantizedLinear at `path`, swapped in for the float Linear there if needed (its
        tensor-parallel part and collective kept; float shards loaded into the Linear before the
        swap carried over as int8)."""
        parent_path, _, attr = path.rpartition(".")
        parent = self.get_submodule(parent_path) if parent_path else self
        current = getattr(parent, attr)
        if isinstance(current, QuantizedLinear):
            return current
        shards = current.split.sizes()
        q = QuantizedLinear(current.in_features, current.out_features, current.bias is not None, shards, current.split)
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

    architectures, model_types, gguf_architectures = ("MistralForCausalLM",), ("mistral",), ("mistral",)


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: Llama with biases on the q/k/v projections."""

    architectures, model_types, gguf_architectures = ("Qwen2ForCausalLM",), ("qwen2",), ("qwen2",)
    qkv_bias = True
    gguf_permuted_qk = False


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: Llama with an RMSNorm over each head of q and k (before RoPE), no q/k/v bias unless
    the config's attention_bias, and head_dim from the config."""

    architectures, model_types, gguf_architectures = ("Qwen3ForCausalLM",), ("qwen3",), ("qwen3",)
    qkv_bias, qk_norm = None, True
    gguf_block_names = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
    gguf_permuted_qk = False


# The pooling models of the family (models/adapters.py): the bare decoders sentence-transformers
# saves (Qwen3-Embedding, gte-Qwen2, e5-mistral: embeddings) and the sequence classifiers
# (Qwen3-Reranker converted, or the original through hf_overrides: rerankers).
POOLING_MODELS = tuple(as_pooling_model(cls, task, f"{prefix}{suffix}")
                       for cls, prefix in ((LlamaForCausalLM, "Llama"), (MistralForCausalLM, "Mistral"),
                                           (Qwen2ForCausalLM, "Qwen2"), (Qwen3ForCausalLM, "Qwen3"))
                       for task, suffix in (("embed", "Model"), ("classify", "ForSequenceClassification")))

MODELS = (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, *POOLING_MODELS)
