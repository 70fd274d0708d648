"""Engine configuration: vLLM's engine-argument names, validated up front."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

# The dtype names a user may give, by their canonical name; torch's dtypes for them live in
# armserve/dtypes.py, so that the server's front end validates a configuration without torch.
DTYPE_NAMES = {
    "float32": "float32",
    "float": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "half": "float16",
    "fp16": "float16",
}

# KV cache space when none is given (no kv_cache_space, $ARMSERVE_KVCACHE_SPACE or
# $VLLM_CPU_KVCACHE_SPACE): vLLM's CPU rule, this fraction of a NUMA node's memory (within the
# cgroup limit) per engine process, shared when more engine processes (data-parallel engines x
# tensor-parallel ranks) than nodes run; never more than max_num_seqs sequences of max_model_len
# can use, and never more than this fraction of what the memory available at start leaves after
# weights and runtime (engine/memory_plan.py). A space given explicitly that does not fit the
# available memory is an error instead.
DEFAULT_KV_CACHE_MEMORY_FRACTION = 0.5

# Files armserve writes once and reads on later starts (converted GGUF tokenizers, quantized
# self-draft copies, OpenVINO IR and its exporter's environments) go in folders under this one;
# ARMSERVE_CACHE_ROOT overrides it.
def cache_dir(name: str) -> str:
    """The cache folder `name` (not created)."""
    root = os.environ.get("ARMSERVE_CACHE_ROOT") or os.path.join(os.path.expanduser("~"), ".cache", "armserve")
    return os.path.join(root, name)


# Seconds between the engine's stats lines while it is busy (ARMSERVE_LOG_STATS_INTERVAL overrides it).
DEFAULT_STATS_INTERVAL = 5.0

# A server queues at most this many requests per running slot (max_num_seqs) before it answers 429:
# enough to keep the batch full while clients back off, never an unbounded backlog.
WAITING_REQUESTS_PER_SEQ = 4

# Weight compression the openvino backend applies when it exports a model (optimum-intel's
# --weight-format); the torch backend quantizes offline (`armserve quantize`).
OPENVINO_QUANTIZATIONS = ("int8", "int4")

# What the engine runs a model for (vLLM's `runner`): "generate" (text), "pooling" (one vector per
# input: embeddings, engine/pooling_backend.py), or "auto": pooling for a model family that only
# pools (models/bert.py), else generate. vLLM's older `task` names map onto them.
RUNNERS = ("auto", "generate", "pooling")
TASK_RUNNERS = {"auto": "auto", "generate": "generate", "embed": "pooling", "embedding": "pooling"}

# Inputs one /v1/embeddings or /pooling request may carry (OpenAI's limit); more: a 400. The server
# keeps at most max_num_seqs of them in the engine at once, so a batch never trips admission (429).
MAX_EMBEDDING_INPUTS = 2048

# The engines `backend` picks from (engine/backend.py: create_engine builds each).
BACKENDS = ("torch", "openvino")


class ConfigError(ValueError):
    """An engine argument is invalid; the message names it."""


def dtype_name(dtype) -> str:
    """The canonical name of a user dtype ("auto", "float32", "bfloat16", "float16"); `dtype` may be a
    name or a torch.dtype (its str is "torch.NAME"). ConfigError if unknown."""
    key = str(dtype).lower() if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if key == "auto":
        return "auto"
    if key not in DTYPE_NAMES:
        if not isinstance(dtype, str):
            raise ConfigError(f"dtype {dtype} is not supported; use float32, bfloat16 or float16")
        raise ConfigError(f"unknown dtype {dtype!r}; expected one of auto, float32, bfloat16, float16")
    return DTYPE_NAMES[key]


# KV cache element types. "auto" stores K/V in the model dtype; "bfloat16" (vLLM's name) too, with the
# model in bfloat16 ("auto" dtype resolves so; another dtype is refused); "int8" stores symmetric int8
# with one float32 scale per (token, kv head) (kernels/reference.py: quantize_kv_ref).
KV_CACHE_DTYPES = ("auto", "int8", "bfloat16")
# vLLM's fp8 names, refused with their own message rather than "unknown".
_FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")


def kv_cache_dtype_name(kv_cache_dtype: str) -> str:
    """"auto", "int8" or "bfloat16" (KV_CACHE_DTYPES); ConfigError naming the alternatives otherwise."""
    key = str(kv_cache_dtype).lower()
    if key in _FP8_KV_CACHE_DTYPES:
        raise ConfigError(
            f"kv_cache_dtype {kv_cache_dtype!r} is not supported yet; use 'int8' for an 8-bit KV cache "
            "(or 'auto' for the model dtype)"
        )
    if key not in KV_CACHE_DTYPES:
        raise ConfigError(f"unknown kv_cache_dtype {kv_cache_dtype!r}; expected one of {', '.join(KV_CACHE_DTYPES)}")
    return key


# The default per-step token budget (`max_num_batched_tokens`) depends on the use, as in vLLM.
# Chunked prefill is always on, so the budget is how much prefill one step may carry, and every
# decoding request waits for the whole step. Offline generation (`LLM`) is judged by throughput:
# 2048 keeps a step's activations small while a long prompt moves in a few steps. A server
# (`AsyncLLM`: `armserve serve`, Ray Serve) is judged by time to first token under load: 32
# prompts arriving together are prefilled 4 per step instead of 16, so most see their first
# token in a fraction of the time; throughput is unchanged (the same work in more, shorter
# steps) and the decoding requests' TPOT takes the prefill they no longer wait for up front.
# Measured with vLLM's bench serve, SmolLM2 bf16, one Zen 4 core, 32 concurrent: median TTFT
# 3991 -> 1590 ms, TPOT 90 -> 124 ms, 211 -> 216 tok/s (docs/benchmarks.md, "batched").
OFFLINE_MAX_NUM_BATCHED_TOKENS = 2048
SERVING_MAX_NUM_BATCHED_TOKENS = 512

# Structured-output grammars (engine/structured_output.py) compile in worker processes, each
# compile killed past its budget (the request fails with a ValueError / HTTP 400 naming "too
# complex"): a 10,000-property JSON schema otherwise compiles for 10+ minutes on one core and
# grows the engine by 1.4 GB. A 1,000-property schema compiles in 1.2 s on SmolLM2's 49k vocab.
# Each is overridable by the environment variable in its comment (read when an engine starts).
GRAMMAR_COMPILE_TIMEOUT = 30.0  # seconds per compile (0: none); ARMSERVE_GRAMMAR_COMPILE_TIMEOUT
GRAMMAR_COMPILE_MEMORY_MB = 1024  # address space a compile may add (0: none); ARMSERVE_GRAMMAR_COMPILE_MEMORY_MB
GRAMMAR_COMPILE_WORKERS = 2  # concurrent compiles (processes); ARMSERVE_GRAMMAR_COMPILE_WORKERS
GRAMMAR_CACHE_MB = 256  # compiled grammars kept (xgrammar's memory_size_bytes); ARMSERVE_GRAMMAR_CACHE_MB

# Stored responses of the Responses API (entrypoints/response_store.py: `store`, previous_response_id),
# in memory or in the SQLite file of `--responses-store`: past either bound the least recently used
# go first. Each is overridable by the environment variable in its comment (read when a server starts).
RESPONSES_STORE_MAX_ENTRIES = 10_000  # ARMSERVE_RESPONSES_STORE_MAX_ENTRIES
RESPONSES_STORE_MAX_MB = 256  # JSON text kept; ARMSERVE_RESPONSES_STORE_MAX_MB


# Logprobs one request may ask for per position (`logprobs`, `prompt_logprobs`, chat's
# `top_logprobs`), as vLLM's --max-logprobs: each is a top-k over the whole vocabulary. -1: no cap.
DEFAULT_MAX_LOGPROBS = 20

# Where a server's default sampling parameters come from (vLLM's --generation-config): "auto" the
# model folder's generation_config.json, "vllm" none (the API's own defaults), else a folder.
DEFAULT_GENERATION_CONFIG = "auto"
# Speculative decoding (engine/spec_decode.py): the methods (vLLM's names).
SPEC_METHODS = ("ngram", "suffix", "draft_model", "eagle3", "mtp")
# `quantization` a draft model may take: "w4a8" quantizes the draft's weights to int4 when it loads
# (quantized self-drafting: `model` = the target's own checkpoint).
SPEC_DRAFT_QUANTIZATIONS = ("w4a8",)
DEFAULT_NUM_SPECULATIVE_TOKENS = 4
# A draft model's LM head over the vocabulary's first this many ids (plus its special tokens), when
# the head is quantized and the vocabulary is larger: BPE and SentencePiece vocabularies are ordered
# roughly by frequency, and a draft step reads its head whole (Qwen2.5's int8 head, 151,936 rows, is
# over 40% of its int4 self-draft's bytes). A token outside is never drafted, so text made mostly of
# later ids (Qwen's Chinese, say) drafts less: 0 keeps the whole vocabulary (docs/speculative_decoding.md).
DEFAULT_DRAFT_VOCAB_SIZE = 49152
# Suffix decoding (engine/suffix_decode.py), vLLM's keys and defaults but one: the trees' depth (a match
# plus its draft), the finished requests' outputs kept for other requests (0: none), draft length
# per matched token, and the least estimated probability of a drafted token. As in vLLM,
# num_speculative_tokens defaults to the tree depth for suffix decoding: the tree bounds each draft
# by its match (max_spec_factor x its length, and the depth less it) and by min_token_prob, so
# only a long, confident match drafts long (a copied span: up to 12 tokens a step at depth 24),
# and the request's adaptive length and the step's verify budget (SPEC_MAX_VERIFY_TOKENS) bound it
# further. (A fixed 8 drafted on every match cost more than 4: SmolLM2 agent loop, 1 thread, 1.12x
# against 1.24x over plain decoding, from lower acceptance.)
DEFAULT_SUFFIX_MAX_TREE_DEPTH = 24
# (vLLM: 10000. A cached output token costs about 160 bytes in the global tree here, so 1000
# answers of 500 tokens hold ~80 MB.)
DEFAULT_SUFFIX_MAX_CACHED_REQUESTS = 1000
DEFAULT_SUFFIX_MAX_SPEC_FACTOR = 1.0
DEFAULT_SUFFIX_MIN_TOKEN_PROB = 0.1
# n-gram lookup: the longest suffix of the sequence (prompt_lookup_max tokens, down to
# prompt_lookup_min) that occurred before proposes the tokens that followed it. One-token matches
# are mostly noise, hence 2.
DEFAULT_PROMPT_LOOKUP_MIN = 2
DEFAULT_PROMPT_LOOKUP_MAX = 5
# A step speculates only while (running decodes) x (1 + min(num_speculative_tokens,
# DEFAULT_NUM_SPECULATIVE_TOKENS)) stays within this many query tokens: beyond it one sequence's
# step no longer reads the weights alone and verifying drafts costs compute a plain decode would
# not spend. Within it each request drafts at most its even share of these query tokens (less its
# own known token), so a lone request over a long match (suffix decoding) drafts up to
# num_speculative_tokens in one step, and 6 at once get 4 each. vLLM's `disable_by_batch_size`
# replaces the rule: a step speculates while at most that many requests run.
SPEC_MAX_VERIFY_TOKENS = 32
# Per request: after a verification that accepted nothing, the request's draft length halves; at 0
# it stops drafting for SPEC_BACKOFF_STEPS steps (doubling each time it is turned off again, up to
# SPEC_MAX_BACKOFF_STEPS), then tries one token again. Every fully accepted run adds one back.
SPEC_BACKOFF_STEPS = 8
SPEC_MAX_BACKOFF_STEPS = 256


# LoRA adapters (armserve/lora/, docs/lora.md), vLLM's defaults: adapters one step may mix
# (`max_loras`, each a slot of stacked weights in every targeted layer), the largest rank a slot
# holds, and adapters kept read on the CPU (None: max_loras).
DEFAULT_MAX_LORAS = 1
DEFAULT_MAX_LORA_RANK = 16


@dataclass(slots=True)
class SpeculativeConfig:
    """`speculative_config` (vLLM's keys): `method` ("ngram", "suffix", "draft_model", "eagle3", "mtp"),
    `num_speculative_tokens` (drafted tokens per step, at most), `prompt_lookup_min` /
    `prompt_lookup_max` (n-gram lengths searched), the `suffix_decoding_*` keys (method "suffix"),
    `model` (method "draft_model": a draft checkpoint with the target's tokenizer; "eagle3": the
    EAGLE-3 head's folder; "mtp": the checkpoint holding the MTP layers, by default the target's),
    `quantization` ("w4a8": the draft quantized to int4 at load), `draft_vocab_size` (method
    "draft_model": its quantized LM head over the first this many token ids and the special tokens;
    0: the whole vocabulary), `draft_tensor_parallel_size` (1) and `disable_by_batch_size` (no
    speculation in a step with more running decodes than this)."""

    method: str = "ngram"
    # (None: DEFAULT_NUM_SPECULATIVE_TOKENS, or for "suffix" the tree depth, as vLLM)
    num_speculative_tokens: int = None  # type: ignore[assignment]
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None
    quantization: str | None = None
    draft_vocab_size: int | None = None
    draft_tensor_parallel_size: int | None = None
    disable_by_batch_size: int | None = None
    suffix_decoding_max_tree_depth: int | None = None
    suffix_decoding_max_cached_requests: int | None = None
    suffix_decoding_max_spec_factor: float | None = None
    suffix_decoding_min_token_prob: float | None = None

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ConfigError(f"speculative_config: unknown method {self.method!r}; expected one of "
                              f"{', '.join(SPEC_METHODS)}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                     "draft_tensor_parallel_size", "disable_by_batch_size", "suffix_decoding_max_tree_depth"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ConfigError(f"speculative_config: {name} must be an integer >= 1, got {v!r}")
        self._check_suffix_keys()
        depth = self.suffix_decoding_max_tree_depth
        if self.num_speculative_tokens is None:
            self.num_speculative_tokens = depth if depth is not None else DEFAULT_NUM_SPECULATIVE_TOKENS
        most = max(16, depth or 0)  # (suffix decoding: up to its tree depth, its default)
        if self.num_speculative_tokens > most:
            raise ConfigError(f"speculative_config: num_speculative_tokens must be <= {most}, got "
                              f"{self.num_speculative_tokens}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo, hi = DEFAULT_PROMPT_LOOKUP_MIN, DEFAULT_PROMPT_LOOKUP_MAX
        elif lo is None:
            lo = min(hi, DEFAULT_PROMPT_LOOKUP_MIN)  # type: ignore[type-var]
        elif hi is None:
            hi = max(lo, DEFAULT_PROMPT_LOOKUP_MAX)
        if lo > hi:  # type: ignore[operator]
            raise ConfigError(f"speculative_config: prompt_lookup_min {lo} is larger than prompt_lookup_max {hi}")
        self.prompt_lookup_min, self.prompt_lookup_max = lo, hi
        if self.method == "ngram" and (self.model is not None or self.quantization is not None):
            raise ConfigError("speculative_config: method 'ngram' takes no draft 'model' or 'quantization'")
        if self.method == "draft_model":
            if not self.model:
                raise ConfigError("speculative_config: method 'draft_model' needs a draft 'model' (a checkpoint "
                                  "with the target's tokenizer, or the target's own path with quantization 'w4a8')")
            if self.quantization is not None and self.quantization not in SPEC_DRAFT_QUANTIZATIONS:
                raise ConfigError(f"speculative_config: unknown draft quantization {self.quantization!r}; expected "
                                  f"{', '.join(SPEC_DRAFT_QUANTIZATIONS)} (or none: the draft as its checkpoint is)")
            v = self.draft_vocab_size
            if v is None:
                self.draft_vocab_size = DEFAULT_DRAFT_VOCAB_SIZE
            elif isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"speculative_config: draft_vocab_size must be an integer >= 0 (0: the whole "
                                  f"vocabulary), got {v!r}")
        elif self.draft_vocab_size is not None:
            raise ConfigError("speculative_config: draft_vocab_size only applies to method 'draft_model'")
        if self.method == "eagle3" and not self.model:
            raise ConfigError("speculative_config: method 'eagle3' needs the head's checkpoint folder as 'model'")
        if self.method in ("eagle3", "mtp") and self.quantization is not None:
            raise ConfigError(f"speculative_config: method {self.method!r} takes no 'quantization' (the head runs "
                              "as its checkpoint is)")
        if self.method in ("draft_model", "eagle3", "mtp") and self.draft_tensor_parallel_size not in (None, 1):
            raise ConfigError("speculative_config: draft_tensor_parallel_size must be 1 (the draft runs on "
                              "the target's first rank)")

    def _check_suffix_keys(self) -> None:
        keys = ("suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
                "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob")
        if self.method != "suffix":
            given = [k for k in keys if getattr(self, k) is not None]
            if given:
                raise ConfigError(f"speculative_config: {', '.join(given)} only apply to method 'suffix'")
            return
        if self.model is not None or self.quantization is not None:
            raise ConfigError("speculative_config: method 'suffix' takes no draft 'model' or 'quantization'")
        defaults = (DEFAULT_SUFFIX_MAX_TREE_DEPTH, DEFAULT_SUFFIX_MAX_CACHED_REQUESTS,
                    DEFAULT_SUFFIX_MAX_SPEC_FACTOR, DEFAULT_SUFFIX_MIN_TOKEN_PROB)
        for k, d in zip(keys, defaults):
            if getattr(self, k) is None:
                setattr(self, k, d)
        n = self.suffix_decoding_max_cached_requests
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ConfigError(f"speculative_config: suffix_decoding_max_cached_requests must be an integer >= 0, "
                              f"got {n!r}")
        f, p = self.suffix_decoding_max_spec_factor, self.suffix_decoding_min_token_prob
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not f >= 0:
            raise ConfigError(f"speculative_config: suffix_decoding_max_spec_factor must be a number >= 0, got {f!r}")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p <= 1:
            raise ConfigError(f"speculative_config: suffix_decoding_min_token_prob must be in [0, 1], got {p!r}")

    @classmethod
    def from_user(cls, value: "SpeculativeConfig | dict | str | None") -> "SpeculativeConfig | None":
        """A SpeculativeConfig from a dict or a JSON object string (the CLI's), or None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            import json

            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ConfigError(f"speculative_config must be a JSON object / dict, got {type(value).__name__}")
        unknown = sorted(set(value) - set(cls.__dataclass_fields__))  # type: ignore[attr-defined]
        if unknown:
            raise ConfigError(f"speculative_config: unknown key(s) {', '.join(map(repr, unknown))}; known: "
                              f"{', '.join(cls.__dataclass_fields__)}")  # type: ignore[attr-defined]
        if "method" not in value:
            raise ConfigError("speculative_config needs a 'method' (e.g. \"ngram\")")
        return cls(**value)

    def draft_share(self, num_running: int) -> int:
        """Tokens each request may draft in a step with `num_running` running requests; 0: the
        step does not speculate (SPEC_MAX_VERIFY_TOKENS, or `disable_by_batch_size` when given)."""
        k = self.num_speculative_tokens
        if self.disable_by_batch_size is not None:
            return k if num_running <= self.disable_by_batch_size else 0
        if num_running * (1 + min(k, DEFAULT_NUM_SPECULATIVE_TOKENS)) > SPEC_MAX_VERIFY_TOKENS:
            return 0
        return min(k, SPEC_MAX_VERIFY_TOKENS // max(num_running, 1) - 1)


@dataclass(slots=True)
class EngineConfig:
    """Everything the engine needs besides the model weights.

    `max_model_len` of None takes the model's own context length. `kv_cache_space` is in GiB
    (default from `ARMSERVE_KVCACHE_SPACE`, else DEFAULT_KV_CACHE_MEMORY_FRACTION of the node's
    memory, as vLLM's CPU backend; the engine fills it in). `kv_cache_dtype` is `auto` (the model dtype)
    or `int8` (per-token-per-head scaled; nearly twice the tokens of a bfloat16 cache).
    """

    model: str
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 256
    block_size: int = 32  # 32+: a bf16 cache block holds whole 32-key AMX value tiles
    enable_prefix_caching: bool = True
    kv_cache_space: float | None = None
    kv_cache_dtype: str = "auto"
    # None: as the checkpoint is (GGUF Q4/Q8 blocks and `armserve quantize` output stay
    # quantized); "none": dequantize every weight to `dtype`; "int8"/"int4": weight compression
    # when the openvino backend exports the model.
    quantization: str | None = None
    seed: int = 0
    tokenizer: str | None = None
    chat_template: str | None = None
    served_model_name: str | None = None
    trust_remote_code: bool = False
    # True: every step runs module by module from Python, never replayed from a recorded step
    # graph (engine/step_graph.py); vLLM's flag for CUDA graphs.
    enforce_eager: bool = False
    # Engines behind one server, each in its own process with its own cores and KV cache of
    # `kv_cache_space` GiB (the server's AsyncLLM only; LLM runs one engine).
    data_parallel_size: int = 1
    # Map the large weights (packed as the kernels read them) from a file under
    # cache_dir("weights") that every engine loading the same model maps too, so engines on one
    # machine hold one copy (model_loader/weight_cache.py). None: on with data_parallel_size > 1
    # on a machine of one NUMA node (across nodes a shared page is remote memory for all engines
    # but one, and decode is bound by read bandwidth).
    share_weights: bool | None = None
    # Ranks one model is split over (armserve/distributed.py), each a process on its own cores
    # (one '|'-separated group each in ARMSERVE_THREADS_BIND, or the allowed cores split evenly);
    # `kv_cache_space` is per rank, each caching its share of the KV heads.
    tensor_parallel_size: int = 1
    # "torch": armserve's own engine; "openvino": OpenVINO GenAI's continuous-batching pipeline
    # (the `openvino` extra; engine/openvino_backend.py). engine/backend.py lists both.
    backend: str = "torch"
    # Admission control of a server (AsyncLLM): past either bound a new request is refused at once
    # (HTTP 429 with Retry-After) instead of queueing without end. Waiting: sent to an engine, no
    # output yet. None: WAITING_REQUESTS_PER_SEQ x max_num_seqs requests (per engine), and as many
    # prompt tokens as the engines' KV caches hold.
    max_waiting_requests: int | None = None
    max_waiting_tokens: int | None = None
    # Seconds a structured-output grammar may take to compile before its request fails with "too
    # complex" (None: GRAMMAR_COMPILE_TIMEOUT or $ARMSERVE_GRAMMAR_COMPILE_TIMEOUT; 0: no limit).
    grammar_compile_timeout: float | None = None
    # RUNNERS: "auto" picks from the checkpoint (LLMEngine resolves it before building the backend).
    runner: str = "auto"
    # Most logprobs a request may ask for per position (DEFAULT_MAX_LOGPROBS; -1: no cap).
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    # Default temperature / top_p / top_k / min_p / repetition_penalty / max_tokens of requests that
    # do not set them: "auto" (the model's generation_config.json), "vllm" (none) or a folder holding one.
    generation_config: str = DEFAULT_GENERATION_CONFIG
    # Speculative decoding (SpeculativeConfig: a dict, a JSON string or the object); None: off.
    speculative_config: SpeculativeConfig | dict | str | None = None
    # LoRA adapters (docs/lora.md): off unless enable_lora; the limits are DEFAULT_MAX_LORAS and
    # DEFAULT_MAX_LORA_RANK; max_cpu_loras None: max_loras.
    enable_lora: bool = False
    max_loras: int = DEFAULT_MAX_LORAS
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK
    max_cpu_loras: int | None = None
    # vLLM's hf_overrides: keys set on the model's transformers config after it is read (a dict or
    # a JSON object string), e.g. the original Qwen3-Reranker's (docs/embeddings.md).
    hf_overrides: dict | str | None = None

    def __post_init__(self) -> None:
        if self.runner not in RUNNERS:
            raise ConfigError(f"unknown runner {self.runner!r}; expected one of {', '.join(RUNNERS)}")
        self.speculative_config = SpeculativeConfig.from_user(self.speculative_config)
        if isinstance(self.hf_overrides, str):
            import json

            try:
                self.hf_overrides = json.loads(self.hf_overrides)
            except ValueError as e:
                raise ConfigError(f"hf_overrides is not valid JSON: {e}") from None
        if self.hf_overrides is not None and not isinstance(self.hf_overrides, dict):
            raise ConfigError(f"hf_overrides must be a JSON object (a dict), got {type(self.hf_overrides).__name__}")
        if self.speculative_config is not None and self.backend != "torch":
            raise ConfigError(f"speculative_config is not supported by the {self.backend} backend")
        if (self.speculative_config is not None and self.speculative_config.method in ("draft_model", "eagle3", "mtp")
                and self.tensor_parallel_size > 1):
            raise ConfigError(f"speculative_config: method {self.speculative_config.method!r} with "
                              "tensor_parallel_size > 1 is not supported yet")
        self._check_lora()
        if self.kv_cache_space is None:
            # (vLLM's CPU name, for setups written for it; armserve's own wins)
            var = next((v for v in ("ARMSERVE_KVCACHE_SPACE", "VLLM_CPU_KVCACHE_SPACE") if os.environ.get(v)), None)
            if var:
                env = os.environ[var]
                try:
                    self.kv_cache_space = float(env)
                except ValueError:
                    raise ConfigError(f"{var} must be a number of GiB, got {env!r}")
        # (None: the engine sizes it by DEFAULT_KV_CACHE_MEMORY_FRACTION once it knows the model)
        if self.kv_cache_space is not None and not self.kv_cache_space > 0:
            raise ConfigError(f"kv_cache_space must be > 0 GiB, got {self.kv_cache_space}")
        # multiples of 16: the attention kernel's key tile (layers/attention.py)
        if self.block_size not in (16, 32, 64, 128):
            raise ConfigError(f"block_size must be one of 16, 32, 64, 128, got {self.block_size}")
        if self.data_parallel_size < 1:
            raise ConfigError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ConfigError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        for name in ("max_waiting_requests", "max_waiting_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be >= 1, got {value}")
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise ConfigError(f"max_logprobs must be -1 (no cap) or an integer >= 0, got {self.max_logprobs!r}")
        if self.generation_config not in ("auto", "vllm") and not os.path.isdir(self.generation_config):
            raise ConfigError(f"generation_config must be 'auto', 'vllm' or a folder holding generation_config.json, "
                              f"got {self.generation_config!r}")
        dtype_name(self.dtype)  # fail early on an unknown dtype
        if self.backend not in BACKENDS:
            raise ConfigError(f"unknown backend {self.backend!r}; expected {' or '.join(BACKENDS)}")
        if self.quantization in OPENVINO_QUANTIZATIONS and self.backend != "openvino":
            raise ConfigError(
                f"quantization {self.quantization!r} is the openvino backend's weight compression; for the torch "
                "backend quantize a checkpoint with `armserve quantize` (or load a Q4/Q8 GGUF)"
            )
        if self.quantization not in (None, "none", "auto", *OPENVINO_QUANTIZATIONS):
            raise ConfigError(
                f"unknown quantization {self.quantization!r}; use None/'auto' (keep the checkpoint's) or 'none' "
                "(or 'int8'/'int4' with backend='openvino')"
            )
        if kv_cache_dtype_name(self.kv_cache_dtype) == "bfloat16" and dtype_name(self.dtype) not in ("auto", "bfloat16"):
            raise ConfigError(f"kv_cache_dtype 'bfloat16' needs the model in bfloat16 (the cache is stored in the "
                              f"model dtype): use dtype 'auto' or 'bfloat16', not {self.dtype!r}")

    def _check_lora(self) -> None:
        for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ConfigError(f"{name} must be an integer >= 1, got {v!r}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        elif self.max_cpu_loras < self.max_loras:
            raise ConfigError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        if not self.enable_lora:
            return
        if self.backend != "torch":
            raise ConfigError(f"enable_lora is not supported by the {self.backend} backend (use backend 'torch')")
        if self.speculative_config is not None:
            raise ConfigError("enable_lora with speculative_config is not supported yet (drafts would run without "
                              "the adapter)")
        if self.tensor_parallel_size > 1:
            raise ConfigError("enable_lora with tensor_parallel_size > 1 is not supported yet")
        if self.runner == "pooling":
            raise ConfigError("enable_lora applies to text generation, not to a pooling model")

    def for_serving(self) -> "EngineConfig":
        """This configuration as a server runs it (`AsyncLLM`: `armserve serve`, Ray Serve): the
        serving step budget when none is given (SERVING_MAX_NUM_BATCHED_TOKENS says why)."""
        if self.max_num_batched_tokens is not None:
            return self
        return replace(self, max_num_batched_tokens=max(SERVING_MAX_NUM_BATCHED_TOKENS, self.max_num_seqs))

    def finalize(self, model_max_len: int) -> None:
        """Fill the limits that depend on the model, once it is known."""
        if self.max_model_len is None:
            self.max_model_len = model_max_len
        elif self.max_model_len > model_max_len:
            raise ConfigError(
                f"max_model_len {self.max_model_len} exceeds the model's context length {model_max_len}"
            )
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = max(OFFLINE_MAX_NUM_BATCHED_TOKENS, self.max_num_seqs)
        if self.share_weights is None:
            from armserve.memory import numa_node_count

            self.share_weights = self.data_parallel_size > 1 and numa_node_count() == 1

    def positions_reached(self) -> int:
        """How many positions a step can rotate (after `finalize`): max_model_len, plus the rows a
        verifying step runs past a sequence's end (num_speculative_tokens), and one to spare."""
        spec = self.speculative_config
        return self.max_model_len + (getattr(spec, "num_speculative_tokens", None) or 0) + 1  # type: ignore[operator]


def check_engine_args(engine_args: dict) -> None:
    """A TypeError naming any engine argument EngineConfig does not know (before anything loads)."""
    known = set(EngineConfig.__dataclass_fields__) - {"model"}  # type: ignore[attr-defined]
    unknown = set(engine_args) - known
    if unknown:
        raise TypeError(f"unknown engine argument(s): {', '.join(sorted(unknown))}; known: {', '.join(sorted(known))}")
