"""The `armserve` command line: `generate` (and, as they land, serve / chat / bench / quantize / info)."""

from __future__ import annotations

import argparse
import json
import sys

from armserve.engine_args import UNSET, add_engine_args, add_sampling_args, engine_kwargs, sampling_params


def cmd_generate(args: argparse.Namespace) -> int:
    from armserve.llm import LLM
    from armserve.model_loader import bundled_model_path

    params = sampling_params(args)  # fail on bad flags before loading the model
    model = args.model or bundled_model_path()
    llm = LLM(model, **engine_kwargs(args))
    prompts = args.prompt or ["The capital of France is"]
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    for out in outs:
        for c in out.outputs:
            if args.json:
                print(json.dumps({"prompt": out.prompt, "index": c.index, "text": c.text,
                                  "token_ids": c.token_ids, "finish_reason": c.finish_reason}))
            else:
                shown = out.prompt if out.prompt is not None else prompts[0]
                print(f"--- {shown!r} [{c.index}] ({c.finish_reason})\n{c.text}")
    return 0


# ---- serve / chat: the OpenAI-compatible server and its terminal client ----------------------


def _add_serving_commands(sub) -> None:
    """`armserve serve [MODEL]` and `armserve chat` (code in armserve.entrypoints)."""
    s = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    s.add_argument("model", nargs="?", default=None, help="HF folder or GGUF file (default: bundled SmolLM2)")
    s.add_argument("--host", default="0.0.0.0", help="address to listen on (default: all interfaces)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None, help="require this bearer key on /v1 (default: $ARMSERVE_API_KEY)")
    s.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use for the model (default: the MODEL argument)")
    s.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help='LoRA adapters served by name (the request\'s "model"): name=path or vLLM\'s JSON '
                        '\'{"name": ..., "path": ..., "base_model_name": ...}\'; needs --enable-lora')
    s.add_argument("--reasoning-parser", default=None, choices=["deepseek_r1", "qwen3"],
                   help="put <think>...</think> text in reasoning_content")
    s.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let the model decide to call tools (tool_choice "auto"); needs --tool-call-parser')
    s.add_argument("--tool-call-parser", default=None, metavar="NAME",
                   help="how to find tool calls in the model's text: hermes (Qwen2.5/Qwen3), llama3_json, "
                        "mistral, pythonic")
    s.add_argument("--allowed-origins", nargs="+", default=None, help="CORS origins (default: *)")
    s.add_argument("--allow-credentials", action="store_true",
                   help="CORS: let browsers send credentials (cookies, auth headers); needs --allowed-origins")
    s.add_argument("--allowed-methods", nargs="+", default=None, help="CORS methods (default: *)")
    s.add_argument("--allowed-headers", nargs="+", default=None, help="CORS headers (default: *)")
    s.add_argument("--max-waiting-requests", type=int, default=None,
                   help="requests queued for the engine before new ones get 429 with Retry-After "
                        "(default: 4 x --max-num-seqs per engine)")
    s.add_argument("--max-waiting-tokens", type=int, default=None,
                   help="prompt tokens queued for the engine before new requests get 429 (default: as many "
                        "as the KV cache holds)")
    s.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                   help="abort a request not finished this long after it arrived (504, or an error event when "
                        "streaming; default: no deadline)")
    s.add_argument("--max-request-body-bytes", type=int, default=None,
                   help="larger request bodies get 413 before they are read (default: 32 MiB)")
    s.add_argument("--body-read-timeout", type=float, default=None, metavar="SECONDS",
                   help="a request body stalled this long gets 408 (default: 30)")
    s.add_argument("--header-read-timeout", type=float, default=None, metavar="SECONDS",
                   help="a connection whose request headers take longer is closed (default: 30)")
    s.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM, refuse new requests and let those in flight finish for up to this long, "
                        "then end the rest with an error (default: 30)")
    s.add_argument("--restart-engine-on-failure", action="store_true",
                   help="start a dead engine core again in place (default: the server exits with code 1, for "
                        "its supervisor to restart it)")
    s.add_argument("--responses-store", default=None, metavar="PATH",
                   help="keep stored Responses (store, previous_response_id) in this SQLite file, so they "
                        "survive a restart (default: in memory)")
    s.add_argument("--disable-log-stats", action="store_true", help="no periodic throughput line")
    s.add_argument("--disable-access-log", action="store_true", help="no per-request access-log line")
    s.add_argument("--enable-log-requests", dest="log_requests", action="store_true", default=False,
                   help="log each request the engine receives (id, prompt tokens, sampling parameters)")
    s.add_argument("--disable-log-requests", dest="log_requests", action="store_false",
                   help="do not log each request the engine receives (the default)")
    s.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key file (PEM)")
    s.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate (chain) file (PEM)")
    s.add_argument("--ssl-ca-certs", default=None, help="CA certificates file, to verify client certificates")
    s.add_argument("--ssl-cert-reqs", type=int, default=0, choices=[0, 1, 2],
                   help="client certificates: 0 not asked for, 1 optional, 2 required (Python's ssl.CERT_*)")
    s.add_argument("--root-path", default="",
                   help="the path prefix a proxy in front serves this server under (e.g. /llm): routes answer "
                        "with and without it, /docs and /openapi.json use it")
    s.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    s.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engines behind this server, each in its own process with its own cores "
                        "(split evenly, or one '|'-separated group each in ARMSERVE_THREADS_BIND) and KV cache")
    s.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="deploy on this running Ray cluster with Ray Serve (e.g. auto, or HOST:6379) instead of "
                        "serving here; needs pip install 'armserve[ray]'")
    s.add_argument("--num-replicas", default="1", metavar="N",
                   help="with --ray-address: Serve replicas (one engine each), or 'auto' to scale on requests in flight")
    s.add_argument("--num-cpus-per-replica", type=float, default=1.0,
                   help="with --ray-address: CPUs each replica reserves (its engine's thread count)")
    add_engine_args(s)
    s.set_defaults(func=_cmd_serve)

    c = sub.add_parser("chat", help="chat with a running armserve (or any OpenAI-compatible) server")
    c.add_argument("--url", default="http://localhost:8000/v1", help="the server's /v1 base URL")
    c.add_argument("--model-name", default=None, help="default: the first model the server lists")
    c.add_argument("--api-key", default=None, help="default: $ARMSERVE_API_KEY or $OPENAI_API_KEY")
    c.add_argument("--system-prompt", default=None)
    c.add_argument("--max-tokens", type=int, default=None)
    c.add_argument("--temperature", type=float, default=None)
    c.add_argument("-q", "--quick", default=None, metavar="MESSAGE", help="ask one question and exit")
    c.set_defaults(func=_cmd_chat)


def _cmd_serve(args: argparse.Namespace) -> int:
    if args.ray_address:
        return _cmd_serve_ray(args)
    from armserve.entrypoints.server_process import run_server  # FastAPI only when serving

    return run_server(args)


def _cmd_serve_ray(args: argparse.Namespace) -> int:
    """`armserve serve MODEL --ray-address ADDR`: the same server as Ray Serve replicas."""
    from armserve.model_loader import bundled_model_path

    replicas: int | str = args.num_replicas
    if replicas != "auto":
        if not str(replicas).isdigit() or int(replicas) < 1:
            raise ValueError(f"--num-replicas must be a positive integer or 'auto', got {replicas!r}")
        replicas = int(replicas)
    if args.data_parallel_size != 1:
        raise ValueError("--data-parallel-size does not combine with --ray-address: use --num-replicas")
    try:
        from armserve.ray import run_on_cluster
    except ImportError as e:
        print(f"armserve: {e}", file=sys.stderr)
        return 1
    from armserve.entrypoints.server_process import check_https_and_root_path

    # NOTE: Serve's HTTP proxy terminates TLS (its http_options take the key, certificate and CA
    # files) but has no setting to ask clients for certificates.
    if args.ssl_cert_reqs:
        raise ValueError("--ssl-cert-reqs does not combine with --ray-address: Ray Serve's HTTP proxy cannot ask "
                         "clients for certificates")
    root_path = check_https_and_root_path(args)
    if args.responses_store:
        from armserve.entrypoints.response_store import ResponseStore

        ResponseStore(args.responses_store).close()  # an unusable file: fail in the driver
    model = args.model or bundled_model_path()
    import os

    from armserve.entrypoints.serving_models import parse_lora_modules

    server = dict(api_key=args.api_key or os.environ.get("ARMSERVE_API_KEY") or None, reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser,
                  enable_auto_tool_choice=args.enable_auto_tool_choice, access_log=not args.disable_access_log,
                  lora_modules=parse_lora_modules(args.lora_modules), root_path=root_path,
                  log_requests=args.log_requests, responses_store=args.responses_store)
    ssl = {k: getattr(args, k) for k in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs") if getattr(args, k)}
    run_on_cluster(args.ray_address, model, replicas, args.host, args.port, ssl=ssl,
                   served_model_name=(args.served_model_name or [None])[0],
                   num_cpus_per_replica=args.num_cpus_per_replica, **server, **engine_kwargs(args))
    return 0


def _cmd_chat(args: argparse.Namespace) -> int:
    from armserve.entrypoints.chat_client import run_chat

    return run_chat(args)


def cmd_quantize(args: argparse.Namespace) -> int:
    from armserve.quantization.quantize import quantize_model

    qcfg = quantize_model(
        args.model, args.out, scheme=args.scheme,
        group_size=args.group_size,
        symmetric=args.symmetric, lm_head=args.lm_head,
        skip_modules=[s for s in args.skip_modules.split(",") if s], dtype=args.dtype,
    )
    print(f"wrote {args.out}: {json.dumps(qcfg)}")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from armserve import __version__
    from armserve.cpu import describe, init_threads

    init_threads()
    info = describe()
    info["armserve"] = __version__
    if args.model:
        info["kv_cache"] = _kv_cache_info(args)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"armserve {info['armserve']}  (torch {info['torch']})")
    print(f"CPU            {info['cpu']} [{info['machine']}], {info['physical_cores']} physical cores, "
          f"{info['logical_cpus']} logical CPUs")
    print(f"features       {' '.join(info['cpu_features']) or '(kernels not loaded)'}")
    print(f"bfloat16       {'native' if info['native_bf16'] else 'emulated'}; dtype=auto -> {info['auto_dtype']} "
          f"({info['auto_dtype_gguf']} for a quantized GGUF)")
    print(f"library        {info['kernel_library'] or 'none'}")
    print(f"variants       built in: {', '.join(info['kernel_variants_compiled']) or 'none'}; "
          f"this CPU runs: {', '.join(info['kernel_variants_supported']) or 'none'}; in use: {info['kernels']['rms_norm']}")
    for family, variant in info["kernels"].items():
        print(f"  {family:18s} {variant}")
    if info["kernels_fix"]:
        print(f"  {info['kernels_fix']}")
    print(f"threads        {info['torch_threads']} (bind: {info['threads_bind'] or 'none'}; "
          f"running on cores {info['thread_cores']})")
    for node, cpus in info["numa_nodes"].items():
        print(f"NUMA node {node}    CPUs {cpus}")
    print(f"OpenMP         kernels and torch share {info['openmp_runtime'] or 'none'}")
    kv = info.get("kv_cache")
    if kv:
        print(f"KV cache       {kv['model']}: {kv['dtype']}, {kv['rows_per_token_per_layer']} x {kv['values_per_row']} "
              f"values per token per layer ({kv['bytes_per_token']} bytes per token): {kv['tokens']} tokens fit in "
              f"{kv['space_gib']:.3g} GiB")
        print(f"memory plan    {kv['model']} as a server with max_model_len {kv['max_model_len']}:")
        for line in kv["memory_plan_lines"]:
            print(f"  {line}")
    return 0


def _kv_cache_info(args: argparse.Namespace) -> dict:
    """The KV cache and memory plan a model would get as a server runs it, from its config and
    tensor metadata alone (no weights are read): values and bytes per token (MLA models cache one
    latent row per layer), the tokens that fit, weights by kind, runtime and total
    (engine/memory_plan.py)."""
    from armserve import model_loader
    from armserve.config import EngineConfig
    from armserve.dtypes import resolve_dtypes
    from armserve.engine.memory_plan import plan_memory
    from armserve.engine.model_runner import kv_cache_bytes_per_token, kv_cache_num_blocks, kv_cache_rows

    fields = ("dtype", "kv_cache_space", "kv_cache_dtype", "block_size", "max_model_len", "max_num_seqs",
              "quantization", "tensor_parallel_size", "data_parallel_size")
    cfg = EngineConfig(model=args.model, **{f: getattr(args, f) for f in fields if hasattr(args, f)}).for_serving()
    src = model_loader.resolve_model_path(args.model)
    hf = model_loader.load_config(src)
    cfg.finalize(getattr(hf, "max_position_embeddings", None) or 2048)
    dtype, cache_dtype = resolve_dtypes(cfg, model_loader.checkpoint_dtype(hf), src.is_gguf)
    plan = plan_memory(cfg, src, hf, dtype, cache_dtype)
    rows, width = kv_cache_rows(hf)
    blocks = kv_cache_num_blocks(hf, cfg.kv_cache_space, cfg.block_size, cache_dtype)
    return {"model": args.model, "dtype": str(cache_dtype).replace("torch.", ""), "rows_per_token_per_layer": rows,
            "values_per_row": width, "bytes_per_token": kv_cache_bytes_per_token(hf, cache_dtype),
            "space_gib": cfg.kv_cache_space, "tokens": blocks * cfg.block_size, "max_model_len": cfg.max_model_len,
            "memory_plan": plan.as_dict(), "memory_plan_lines": plan.lines()}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="armserve", description="LLM inference and serving on CPUs")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate completions offline")
    g.add_argument("--model", default=None, help="HF folder or GGUF file (default: bundled SmolLM2)")
    g.add_argument("--prompt", action="append", default=None, help="prompt text (repeatable)")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    g.add_argument("--json", action="store_true", help="one JSON object per completion")
    add_engine_args(g)
    add_sampling_args(g)
    g.set_defaults(func=cmd_generate)
    _add_serving_commands(sub)

    qz = sub.add_parser("quantize", help="write an int4-weight (w4a8) checkpoint folder")
    qz.add_argument("model", help="HF folder or GGUF file")
    qz.add_argument("out", help="output folder (must not exist or be empty)")
    qz.add_argument("--scheme", default="w4a8", choices=["w4a8"])
    qz.add_argument("--group-size", default="32", help="32, 64, 128 or channel")
    qz.add_argument("--symmetric", action="store_true", help="no zero points (codes = q + 8)")
    qz.add_argument("--lm-head", default="int8", choices=["int8", "int4", "keep"],
                    help="LM head format: int8 (default), int4 like the other layers, or keep (--dtype)")
    qz.add_argument("--skip-modules", default="", help="comma-separated name parts kept in --dtype")
    qz.add_argument("--dtype", default="bfloat16", help="dtype of the tensors that stay unquantized")
    qz.set_defaults(func=cmd_quantize)

    i = sub.add_parser("info", help="CPU features, kernel variants, threads and NUMA layout")
    i.add_argument("--json", action="store_true")
    i.add_argument("--model", default=None, help="also show this model's KV cache (bytes per token, tokens that "
                   "fit) and memory plan (weights by kind, KV cache, runtime, total), from its metadata alone")
    i.add_argument("--dtype", default=UNSET)
    i.add_argument("--kv-cache-dtype", default=UNSET)
    i.add_argument("--kv-cache-space", type=float, default=None, help="GiB (default: $ARMSERVE_KVCACHE_SPACE, else half the NUMA node's memory, vLLM's CPU rule)")
    i.add_argument("--block-size", type=int, default=UNSET)
    i.add_argument("--max-model-len", type=int, default=None, help="context length planned for (default: the model's)")
    i.add_argument("--max-num-seqs", type=int, default=UNSET)
    i.add_argument("--quantization", default=None, help="none: plan dequantized weights")
    i.add_argument("--tensor-parallel-size", type=int, default=UNSET)
    i.add_argument("--data-parallel-size", type=int, default=UNSET)
    i.set_defaults(func=cmd_info)

    # ---- bench: latency / throughput / serve / plot (code in armserve.benchmarks) ----
    from armserve.benchmarks import add_bench_commands

    add_bench_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:  # our errors all derive from ValueError and name the problem
        print(f"armserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
