"""armserve on Ray: a Ray Serve deployment of the OpenAI server, and offline batch inference over
a Ray Data dataset (`pip install 'armserve[ray]'`).

    Ray Serve proxy ──► replica 0: AsyncLLM + the OpenAI app (api_server.build_app)
      (HTTP, :8000) └─► replica 1: ...                    one replica per node / NUMA node

    ray.data.Dataset ──map_batches──► actor 0: LLM ──► rows + generated_text
                                  └─► actor 1: LLM ──► ...

A replica is an ordinary armserve server (the same routes, the same `/metrics`); Serve balances
requests over replicas, restarts a replica whose actor dies (its in-flight requests end with an
error, the others go on) or whose engine stops (`check_health`), and with autoscaling adds and
removes replicas on the number of requests in flight per replica (Serve's `target_ongoing_requests`).
"""

from __future__ import annotations

from typing import Any

try:
    import ray
    from ray import serve
except ImportError:  # pragma: no cover - exercised by hand
    raise ImportError("armserve.ray needs Ray: pip install 'armserve[ray]'") from None

import numpy as np

from armserve.config import EngineConfig, check_engine_args
from armserve.sampling_params import SamplingParams

__all__ = ["ArmserveDeployment", "generate_batch", "serve_app", "run_on_cluster"]

# Requests one replica takes at once before Serve queues them (Serve's own default is 5, far
# below what one engine batches; past max_num_seqs the engine queues them itself).
DEFAULT_MAX_ONGOING_REQUESTS = 256
# With num_replicas="auto": a replica per 32 requests in flight, between 1 and 8 replicas.
DEFAULT_AUTOSCALING = {"min_replicas": 1, "max_replicas": 8, "target_ongoing_requests": 32}

# build_app's arguments (root_path: routes answer with and without it, as `armserve serve`;
# responses_store: a SQLite file each replica opens, shared by the replicas of one node)
_SERVER_ARGS = ("api_key", "reasoning_parser", "tool_call_parser", "enable_auto_tool_choice", "access_log",
                "lora_modules", "root_path", "log_requests", "responses_store")


@serve.ingress()
class ArmserveDeployment:
    """One replica: an `AsyncLLM` and armserve's OpenAI app over it (the app is built after the
    engine, so Serve takes it from `__serve_build_asgi_app__`)."""

    def __init__(self, model: str, served_model_name: str | None, engine_args: dict[str, Any],
                 server_args: dict[str, Any]) -> None:
        from armserve.engine.async_llm import AsyncLLM
        from armserve.entrypoints.api_server import build_app
        from armserve.entrypoints.server_process import default_served_name
        from armserve.entrypoints.metrics import PrometheusMetrics
        from armserve.model_source import resolve_model_path

        path = resolve_model_path(model).path  # a wrong path fails before the engine starts
        name = served_model_name or default_served_name(model, path)
        metrics = PrometheusMetrics(name, engine_args.get("data_parallel_size", 1))
        self.engine = AsyncLLM(EngineConfig(model=path, served_model_name=name, **engine_args),
                               log_stats=False, stat_loggers=[metrics])
        metrics.set_cache_config(self.engine)
        # _SERVER_ARGS are build_app's own names; no access log unless asked for
        self._openai_app = build_app(self.engine, [name], metrics, **{"access_log": False, **server_args})

    def __serve_build_asgi_app__(self):
        return self._openai_app

    def check_health(self) -> None:
        """Serve calls this periodically: a replica whose engine stopped is replaced."""
        if not self.engine.is_running:
            raise RuntimeError(f"the engine is not running: {self.engine.dead_error}")


def serve_app(model: str, num_replicas: int | str = 1, *, num_cpus_per_replica: float = 1.0,
              autoscaling_config: dict[str, Any] | None = None,
              max_ongoing_requests: int = DEFAULT_MAX_ONGOING_REQUESTS, served_model_name: str | None = None,
              name: str = "armserve", **engine_args: Any) -> "serve.Application":
    """A Ray Serve application serving `model` with armserve's OpenAI routes.

    `num_replicas` replicas (or `"auto"`: autoscaling on requests in flight, `autoscaling_config`
    in Serve's terms, default `DEFAULT_AUTOSCALING`), each an actor reserving `num_cpus_per_replica`
    CPUs (Ray sets its OMP_NUM_THREADS to match, and armserve runs that many threads). Engine
    arguments are `LLM`'s (`dtype`, `max_model_len`, `kv_cache_space`, ...); `api_key`,
    `reasoning_parser`, `tool_call_parser`, `enable_auto_tool_choice`, `access_log`, `root_path`,
    `log_requests`, `responses_store` and `lora_modules` ((name, path, base model name) of each LoRA
    adapter, with `enable_lora=True`) go to the server (`_SERVER_ARGS`).

        serve.run(armserve.ray.serve_app("Qwen/Qwen2.5-0.5B-Instruct", num_replicas=2), route_prefix="/")
    """
    server_args = {k: engine_args.pop(k) for k in _SERVER_ARGS if k in engine_args}
    check_engine_args(engine_args)  # fail in the driver, not in every replica
    EngineConfig(model=model, **engine_args)  # bad values fail here too
    options: dict[str, Any] = {"name": name, "max_ongoing_requests": max_ongoing_requests,
                               "ray_actor_options": {"num_cpus": num_cpus_per_replica}}
    if num_replicas == "auto" or autoscaling_config is not None:
        options["autoscaling_config"] = dict(DEFAULT_AUTOSCALING, **(autoscaling_config or {}))
    else:
        if not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"num_replicas must be a positive int or 'auto', got {num_replicas!r}")
        options["num_replicas"] = num_replicas
    deployment = serve.deployment(ArmserveDeployment).options(**options)
    return deployment.bind(model, served_model_name, engine_args, server_args)


def run_on_cluster(address: str, model: str, num_replicas: int | str, host: str, port: int,
                   route_prefix: str = "/", ssl: dict[str, str] | None = None, **kwargs: Any) -> None:
    """`armserve serve MODEL --ray-address ADDR`: deploy on a running cluster and wait; SIGINT
    (Ctrl-C) or SIGTERM deletes the application. `ssl`: Serve's proxy serves HTTPS with these
    files (`ssl_keyfile`, `ssl_certfile`, `ssl_ca_certs`: --ssl-* of `armserve serve`). A process killed otherwise leaves it running on
    the cluster (Serve applications outlive their driver; `serve shutdown` removes them)."""
    import signal
    import threading

    ray.init(address=address)
    stop = threading.Event()
    # NOTE: installed after ray.init: Ray's core worker replaces the handlers it finds at start-up
    # with its own (which exit without cleaning up). A signal during serve.run deletes the app
    # once it is deployed.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    serve.start(http_options={"host": host, "port": port, **(ssl or {})})
    serve.run(serve_app(model, num_replicas, **kwargs), name="armserve", route_prefix=route_prefix)
    while not stop.wait(1):
        pass
    serve.delete("armserve")


class _Generator:
    """One Ray Data actor: an `LLM` loaded once, generating for each batch of rows."""

    def __init__(self, model: str, sampling_params: SamplingParams | None, engine_args: dict[str, Any]) -> None:
        from armserve.llm import LLM

        self.llm = LLM(model, **engine_args)
        self.params = sampling_params or SamplingParams()

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        prompts = [p if isinstance(p, str) else list(p) for p in batch["prompt"]]
        outs = self.llm.generate(prompts, self.params, use_tqdm=False)
        batch["generated_text"] = np.array([o.outputs[0].text for o in outs], dtype=object)
        batch["num_generated_tokens"] = np.array([len(o.outputs[0].token_ids) for o in outs], dtype=np.int64)
        return batch


def generate_batch(ray_dataset: "ray.data.Dataset", model: str, sampling_params: SamplingParams | None = None, *,
                   concurrency: int = 1, num_cpus: float = 1.0, batch_size: int = 64,
                   **engine_args: Any) -> "ray.data.Dataset":
    """Offline batch inference: each row's `prompt` (text or token ids) completed by one of
    `concurrency` engine actors (one `LLM` each, `num_cpus` CPUs each).

    Rows keep their columns and gain `generated_text` and `num_generated_tokens` (as vLLM's Ray
    Data processor does); `batch_size` rows go to an engine at once, and it batches them itself.
    The result is lazy, like any Ray Data dataset: iterate, `take_all()` or write it.
    """
    check_engine_args(engine_args)
    if "prompt" not in ray_dataset.columns():
        raise ValueError(f"the dataset needs a 'prompt' column; it has {ray_dataset.columns()}")
    return ray_dataset.map_batches(_Generator, fn_constructor_args=(model, sampling_params, engine_args),
                                   compute=ray.data.ActorPoolStrategy(size=concurrency), num_cpus=num_cpus,
                                   batch_size=batch_size, batch_format="numpy")
