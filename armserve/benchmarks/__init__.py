"""`armserve bench latency | throughput | serve | plot`: benchmarks of armserve and of any
OpenAI-compatible server, with vLLM's `bench serve` metric definitions (see `metrics.py`)."""

from __future__ import annotations

import argparse

# subcommand -> (module, help); modules are imported only when their command runs or is parsed.
_COMMANDS = {
    "latency": ("latency", "batch-1 TTFT and decode speed of the offline engine over prompt lengths"),
    "throughput": ("throughput", "offline throughput of the engine on N prompts at once"),
    "serve": ("serve", "load an OpenAI-compatible server (Poisson arrivals or fixed concurrency)"),
    "plot": ("plot", "plot throughput against TTFT and TPOT from `bench serve` results"),
}


def add_bench_commands(sub) -> None:
    """Add `bench` and its subcommands to the `armserve` subparsers `sub`."""
    import importlib

    bench = sub.add_parser("bench", help="benchmarks: latency, throughput, serve, plot")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    for name, (module, help_text) in _COMMANDS.items():
        mod = importlib.import_module(f"armserve.benchmarks.{module}")
        p = bsub.add_parser(name, help=help_text, description=mod.__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_cli_args(p)
        p.set_defaults(func=mod.main)
