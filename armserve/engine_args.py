"""Engine and sampling arguments on the command line (vLLM's flag names), shared by every
command that loads a model: `armserve generate / serve / bench`, and the server's runner."""

from __future__ import annotations

import argparse

# A flag not given is left out of engine_kwargs: EngineConfig (armserve/config.py) holds the defaults.
UNSET = argparse.SUPPRESS


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine flags shared by every subcommand that loads a model (vLLM's names)."""
    p.add_argument("--dtype", default=UNSET, help="auto (the default), float32, bfloat16 or float16")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens one engine step may carry (prompts longer are prefilled in chunks); default "
                        "512 for a server (time to first token under load), 2048 offline (throughput)")
    p.add_argument("--max-num-seqs", type=int, default=UNSET)
    p.add_argument("--block-size", type=int, default=UNSET)
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    p.add_argument("--kv-cache-space", type=float, default=None,
                   help="KV cache size in GiB (default: $ARMSERVE_KVCACHE_SPACE, else half the NUMA node's memory "
                        "as vLLM's CPU backend, within what the machine has available)")
    p.add_argument("--kv-cache-dtype", default=UNSET,
                   help="auto (the model dtype) or int8 (8-bit cache with per-token-per-head scales)")
    p.add_argument("--seed", type=int, default=UNSET)
    p.add_argument("--enforce-eager", action="store_true",
                   help="run every step module by module (no replayed decode step graphs)")
    p.add_argument("--chat-template", default=None, help="a Jinja chat template file or string")
    p.add_argument("--tokenizer", default=None,
                   help="the tokenizer's HF folder (or a GGUF / tokenizer.json file) when the model's own is missing "
                        "or unusable (e.g. a GGUF whose header has none); default: the model's")
    p.add_argument("--max-logprobs", type=int, default=UNSET,
                   help="most logprobs a request may ask for per token (logprobs, prompt_logprobs, top_logprobs; "
                        "more is a 400); -1: no cap (default: 20)")
    p.add_argument("--generation-config", default=UNSET,
                   help="default sampling parameters of requests that do not set them (temperature, top_p, top_k, "
                        "min_p, repetition_penalty, max_tokens): auto (the model's generation_config.json, the "
                        "default), vllm (none: the API's defaults) or a folder holding a generation_config.json")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=UNSET,
                   help="split the model over this many ranks, each a process on its own cores (one "
                        "'|'-separated group each in ARMSERVE_THREADS_BIND, or the allowed cores split evenly)")
    p.add_argument("--backend", default=UNSET, choices=["torch", "openvino"],
                   help="torch: armserve's own engine; openvino: OpenVINO GenAI's continuous-batching pipeline "
                        "(pip install armserve[openvino], and python -m armserve.engine.openvino_backend --install-exporter "
                        "for the exporter; the model is exported to OpenVINO IR once)")
    p.add_argument("--runner", default=UNSET, choices=["auto", "generate", "pooling"],
                   help="generate (text) or pooling (embeddings and scores: /v1/embeddings, /pooling, /score, /rerank; "
                        "a decoder too); auto (the default) picks pooling for an embedding or reranking checkpoint "
                        "(BertModel, Qwen3Model, *ForSequenceClassification, a GGUF with a pooling type), else generate")
    p.add_argument("--task", default=UNSET, choices=["auto", "generate", "embed"],
                   help="vLLM's older name for --runner: embed = pooling")
    p.add_argument("--grammar-compile-timeout", type=float, default=None, metavar="SECONDS",
                   help="a structured-output grammar that does not compile in this time fails its request "
                        "(400, too complex; default: $ARMSERVE_GRAMMAR_COMPILE_TIMEOUT or 30; 0: no limit)")
    p.add_argument("--quantization", "-q", default=None,
                   help="none: dequantize a quantized checkpoint; int8/int4: weight compression when the "
                        "openvino backend exports the model (default: as the checkpoint is)")
    p.add_argument("--enable-lora", action="store_true", default=UNSET,
                   help="serve LoRA adapters (PEFT folders) over the base model, mixed in one batch (docs/lora.md)")
    p.add_argument("--max-loras", type=int, default=UNSET,
                   help="adapters one step may mix (requests on more wait; default 1)")
    p.add_argument("--max-lora-rank", type=int, default=UNSET, help="the largest adapter rank accepted (default 16)")
    p.add_argument("--max-cpu-loras", type=int, default=UNSET,
                   help="adapters kept read in memory, least recently used dropped first (default: --max-loras)")
    p.add_argument("--hf-overrides", default=UNSET, metavar="JSON",
                   help="keys to set on the model's config after it is read, as a JSON object (vLLM's), e.g. "
                        "'{\"architectures\": [\"Qwen3ForSequenceClassification\"], \"classifier_from_token\": "
                        "[\"no\", \"yes\"], \"is_original_qwen3_reranker\": true}' for the original Qwen3-Reranker")
    p.add_argument("--share-weights", action=argparse.BooleanOptionalAction, default=UNSET,
                   help="map the packed weights from a file under ~/.cache/armserve/weights that every engine loading "
                        "the same model maps too: engines on one machine hold one copy (default: on with "
                        "--data-parallel-size > 1 on a machine of one NUMA node)")
    p.add_argument("--speculative-config", default=UNSET, metavar="JSON",
                   help='speculative decoding, vLLM\'s keys as a JSON object, e.g. \'{"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_max": 5}\' (docs/speculative_decoding.md)')


ENGINE_FLAGS = ("dtype", "max_model_len", "max_num_batched_tokens", "max_num_seqs", "block_size",
                "enable_prefix_caching", "kv_cache_space", "kv_cache_dtype", "seed", "enforce_eager", "chat_template",
                "tensor_parallel_size", "backend", "quantization", "grammar_compile_timeout", "runner", "tokenizer",
                "max_logprobs", "generation_config", "speculative_config", "enable_lora", "max_loras", "max_lora_rank",
                "max_cpu_loras", "hf_overrides", "share_weights")


def engine_kwargs(args: argparse.Namespace) -> dict:
    """EngineConfig's arguments from the flags given (a chat template file is read)."""
    kwargs = {f: getattr(args, f) for f in ENGINE_FLAGS if hasattr(args, f)}
    if hasattr(args, "task"):
        from armserve.config import TASK_RUNNERS

        runner = TASK_RUNNERS[args.task]
        if kwargs.get("runner", runner) != runner:
            raise SystemExit(f"--task {args.task} contradicts --runner {kwargs['runner']}")
        kwargs["runner"] = runner
    template = kwargs["chat_template"]
    if template:
        import os

        if os.path.isfile(template):
            with open(template) as f:
                kwargs["chat_template"] = f.read()
    return kwargs


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--min-tokens", type=int, default=0)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--n", type=int, default=1)


def sampling_params(args: argparse.Namespace):
    from armserve.sampling_params import SamplingParams

    names = ("n", "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
             "frequency_penalty", "repetition_penalty", "stop", "ignore_eos")  # SamplingParams' own names
    return SamplingParams(**{f: getattr(args, f) for f in names}, seed=args.sampling_seed)
