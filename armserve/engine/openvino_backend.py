"""The OpenVINO backend: a model served through OpenVINO GenAI's continuous-batching pipeline
(paged attention, prefix caching, chunked prefill), behind token ids like armserve's own
(engine/backend.py).

    add_request ── SamplingParams -> GenerationConfig ──► pipeline.add_request -> GenerationHandle
    step()      ── pipeline.step(); handle.read() per request ──► each sequence's new token ids
                   (+ the chosen token's logprob, finish reason); the engine's output processor
                   makes the text, stop strings and streaming deltas

The model is exported once to OpenVINO IR with optimum-intel (`optimum-cli export openvino`,
in a subprocess: see `export_python`) into `~/.cache/armserve/openvino/` (or
$ARMSERVE_OPENVINO_CACHE), keyed by the model folder, its config and the weight format; a folder
that already holds `openvino_model.xml` loads directly.

Prompts are tokenized and outputs detokenized by the engine with armserve's tokenizer, so chat
templates, stop strings and streamed text behave exactly as with the torch backend. Sampling parameters the
pipeline cannot honour are refused with a ValueError naming them (`generation_config`).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import random
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from armserve import model_loader
from armserve.config import OPENVINO_QUANTIZATIONS, ConfigError, EngineConfig, cache_dir
from armserve.dtypes import resolve_dtype, resolve_dtypes
from armserve.engine.backend import BackendOutput, SequenceOutput, run_dummy_request
from armserve.engine.input_processor import EngineCoreRequest
from armserve.engine.stats import SchedulerStats
from armserve.sampling_params import SamplingParams

logger = logging.getLogger("armserve")

# NOTE: the exporter (optimum-intel, which pins transformers < 5.6) lives in an environment of its
# own, made for the running one by `install_exporter`, so serving never depends on its pins; the
# `openvino` extra holds only the runtime. The hints name this interpreter, so they install into
# the environment that asked.
_PY = shlex.quote(sys.executable or "python3")
INSTALL_EXPORTER = f"{_PY} -m armserve.engine.openvino_backend --install-exporter"
INSTALL_HINT = (f"the openvino backend needs its extra: {_PY} -m pip install armserve[openvino] "
                f"(and, to export Hugging Face folders to OpenVINO IR, its exporter: {INSTALL_EXPORTER})")
EXPORTER_HINT = f"exporting to OpenVINO IR needs the exporter's environment: {INSTALL_EXPORTER}"
IR_FILE = "openvino_model.xml"
# OpenVINO's CPU plugin pages its KV cache in blocks of 32 tokens.
OV_CPU_BLOCK_SIZE = 32
# The exporter's environments, one per Python environment that serves (`export_env_dir`).
EXPORT_ENVS = cache_dir("openvino-export-envs")
# What the exporter's environment adds to the serving one: optimum-intel (installed --no-deps, see
# `install_exporter`) and its other requirements, with the transformers it supports. The
# OpenVINO pins are the `openvino` extra's (pyproject.toml), so an IR is written by the runtime
# that reads it; packages the serving environment already has (torch, openvino) are not installed again.
EXPORTER_NO_DEPS = ["optimum-intel==2.2.0"]
EXPORTER_REQUIREMENTS = ["optimum==2.3.0", "nncf==3.4.0", "transformers>=5.0,<5.6", "huggingface-hub>=0.23.2,<1.22",
                         "requests>=2.33,<3", "setuptools", "openvino==2026.4.1", "openvino-tokenizers==2026.4.1.0"]


def import_openvino_genai():
    """openvino_genai, or an ImportError of one line saying how to install it."""
    try:
        import openvino  # noqa: F401
        import openvino_genai
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} ({e})") from None
    return openvino_genai


# ---- export ------------------------------------------------------------------------------------


def is_ir_folder(path: str) -> bool:
    return os.path.isfile(os.path.join(path, IR_FILE))


def weight_format(dtype: str, quantization: str | None) -> str:
    """optimum-intel's --weight-format for an engine dtype and quantization."""
    if quantization in OPENVINO_QUANTIZATIONS:
        return quantization
    return "fp32" if resolve_dtype(dtype) == torch.float32 else "fp16"


def int4_group_size(folder: str) -> int:
    """The int4 group size for the model in `folder`: NNCF's default 128, halved until it divides
    every matmul's input width (hidden size, attention output width, MLP width); NNCF refuses a
    group that does not divide one (SmolLM2's hidden size is 576)."""
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    cfg = cfg.get("text_config", cfg)
    hidden = int(cfg["hidden_size"])
    heads = int(cfg.get("num_attention_heads") or 1)
    widths = [hidden, int(cfg.get("head_dim") or hidden // heads) * heads]
    widths += [int(cfg[k]) for k in ("intermediate_size", "moe_intermediate_size") if cfg.get(k)]
    g = 128
    while g > 16 and any(w % g for w in widths):
        g //= 2
    return g


def export_env_dir(prefix: str | None = None) -> str:
    """The exporter's environment for the Python environment at `prefix` (default: this one,
    sys.prefix): one per environment, since it sees that environment's packages (`install_exporter`)."""
    prefix = os.path.realpath(prefix or sys.prefix)
    tag = hashlib.sha256(prefix.encode()).hexdigest()[:10]
    return os.path.join(EXPORT_ENVS, f"{os.path.basename(prefix) or 'python'}-{tag}")


def _env_python(env: str) -> str:
    return os.path.join(env, "Scripts", "python.exe") if os.name == "nt" else os.path.join(env, "bin", "python")


def export_python() -> str:
    """The Python that runs the export: $ARMSERVE_OPENVINO_EXPORT_PYTHON, else the exporter's
    environment made for this environment (`install_exporter`), else this interpreter."""
    env = os.environ.get("ARMSERVE_OPENVINO_EXPORT_PYTHON")
    if env:
        return env
    python = _env_python(export_env_dir())
    return python if os.path.isfile(python) else sys.executable


def install_exporter(quiet: bool = True) -> str:
    """Make (or bring up to date) the exporter's environment for this Python environment; returns
    its python.

    A venv made by this interpreter, without system site packages, whose .pth file adds this
    environment's site-packages *after* its own: it sees torch, openvino and the rest as they are
    here (so pip installs none of them again, and never a torch of its own), while its own
    optimum-intel, transformers < 5.6 and huggingface-hub < 1.22 come first. (A
    `--system-site-packages` venv would see the base interpreter's packages, not a virtualenv's.)
    optimum-intel goes in with --no-deps: it declares torchvision, which the export never imports
    and which pip would take as a CUDA build that breaks `import transformers`.
    """
    import site
    import venv

    env = export_env_dir()
    python = _env_python(env)
    marker = os.path.join(env, "armserve-export-env.json")
    want = {"for_prefix": os.path.realpath(sys.prefix), "python": sys.version.split()[0]}
    try:
        with open(marker) as f:
            fresh = json.load(f) != want
    except (OSError, ValueError):
        fresh = True
    print(f"armserve: the OpenVINO exporter's environment for {sys.prefix}: {env}", flush=True)
    venv.EnvBuilder(clear=fresh, symlinks=os.name != "nt", with_pip=False).create(env)
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             check=True, stdout=subprocess.PIPE, text=True).stdout.strip()
    dirs = [d for d in site.getsitepackages() if os.path.isdir(d)]
    if site.ENABLE_USER_SITE and os.path.isdir(site.getusersitepackages()):
        dirs.append(site.getusersitepackages())
    # site.addsitedir appends, and runs those folders' own .pth files (editable installs and the like).
    with open(os.path.join(purelib, "armserve-serving-env.pth"), "w") as f:
        f.write("".join(f"import site; site.addsitedir({d!r})\n" for d in dirs))
    have_pip = subprocess.run([python, "-c", "import pip"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL).returncode == 0
    if not have_pip:  # a serving environment without pip (uv's venvs): the exporter gets its own
        subprocess.run([python, "-m", "ensurepip", "--default-pip"], check=True, stdout=subprocess.DEVNULL)
    pip = [python, "-m", "pip", "install", *(["-q"] if quiet else []),
           # pip's post-install check would look at the serving environment's packages too (an
           # xgrammar without triton, say), which the export never imports: the import below is
           # the check that counts.
           "--no-warn-conflicts"]
    subprocess.run([*pip, *EXPORTER_REQUIREMENTS], check=True)
    subprocess.run([*pip, "--no-deps", *EXPORTER_NO_DEPS], check=True)
    check = ("import transformers, optimum.intel; from optimum.exporters.openvino import main_export; "
             "v = tuple(int(x) for x in transformers.__version__.split('.')[:2]); "
             "assert v < (5, 6), transformers.__version__; print(transformers.__version__)")
    version = subprocess.run([python, "-c", check], check=True, stdout=subprocess.PIPE, text=True).stdout.strip()
    with open(marker, "w") as f:
        json.dump(want, f)
    print(f"armserve: the OpenVINO exporter is ready ({python}, transformers {version})", flush=True)
    return python


def cache_root() -> str:
    return os.environ.get("ARMSERVE_OPENVINO_CACHE") or cache_dir("openvino")


def ir_cache_dir(folder: str, fmt: str) -> str:
    """The cache folder of one export: the model's path, its config.json and the weight format."""
    folder = os.path.realpath(folder)
    h = hashlib.sha256(folder.encode())
    with open(os.path.join(folder, "config.json"), "rb") as f:
        h.update(f.read())
    h.update(fmt.encode())
    return os.path.join(cache_root(), f"{os.path.basename(folder)}-{fmt}-{h.hexdigest()[:10]}")


def export_ir(folder: str, fmt: str, trust_remote_code: bool = False) -> str:
    """The OpenVINO IR of the Hugging Face model in `folder`, exported once into the cache."""
    out = ir_cache_dir(folder, fmt)
    if is_ir_folder(out):
        return out
    python = export_python()
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    cmd = [python, "-m", "optimum.commands.optimum_cli", "export", "openvino", "--model", folder,
           "--task", "text-generation-with-past", "--weight-format", fmt, tmp]
    if fmt == "int4":
        cmd[-1:-1] = ["--group-size", str(int4_group_size(folder))]
    if trust_remote_code:
        cmd.insert(-1, "--trust-remote-code")
    logger.info("exporting %s to OpenVINO IR (%s weights) into %s; this happens once per model and format",
                folder, fmt, out)
    t0 = time.time()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0 or not is_ir_folder(tmp):
        shutil.rmtree(tmp, ignore_errors=True)
        tail = "\n".join(proc.stdout.strip().splitlines()[-15:])
        if "No module named 'optimum" in proc.stdout:
            raise ImportError(f"{EXPORTER_HINT} (optimum-intel is missing from {python})")
        raise RuntimeError(f"exporting {folder} to OpenVINO IR failed ({' '.join(cmd)}):\n{tail}")
    os.replace(tmp, out) if not os.path.exists(out) else shutil.rmtree(tmp)
    logger.info("exported %s to OpenVINO IR in %.0f s", folder, time.time() - t0)
    return out


# ---- threads -----------------------------------------------------------------------------------


def thread_settings() -> tuple[int, list[int] | None]:
    """(threads, cores to pin to or None) from armserve's settings (armserve/cpu.py):
    ARMSERVE_THREADS_BIND (or vLLM's VLLM_CPU_OMP_THREADS_BIND), else OMP_NUM_THREADS, else one
    thread per physical core."""
    from armserve import cpu

    var, bind = cpu.one_binding()
    if bind:
        cores = cpu.bound_cores(var, bind)
        return len(cores), cores
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) > 0:
        return int(omp), None
    return max(1, len(cpu.physical_cores())), None


# ---- requests ----------------------------------------------------------------------------------

# The pipeline's precision names for armserve's model and KV cache dtypes (config.resolve_dtypes).
_PRECISIONS = {torch.float32: "f32", torch.bfloat16: "bf16", torch.int8: "u8"}


@dataclass
class _Request:
    request_id: str
    num_prompt_tokens: int
    params: SamplingParams
    handle: Any
    num_tokens: list[int]  # tokens read so far, per sequence
    seq_index: dict[int, int] = field(default_factory=dict)  # pipeline sequence id -> completion index
    done: set[int] = field(default_factory=set)  # sequences ended (by the pipeline, or aborted)
    got_tokens: bool = False


class OpenVINOBackend:
    """The backend interface (engine/backend.py) over `openvino_genai.ContinuousBatchingPipeline`.

    Not thread-safe: one thread calls `add_request`, `abort_request` and `step`.
    """

    structured = None  # structured outputs are refused (add_request names the parameter)

    def __init__(self, config: EngineConfig) -> None:
        genai = import_openvino_genai()
        self._genai = genai
        self.config = config
        self._check_config(config)
        t0 = time.time()
        src = model_loader.resolve_model_path(config.model)
        if src.is_gguf:
            raise ConfigError(
                f"the openvino backend exports Hugging Face folders, not GGUF files ({config.model}); convert it "
                "to a folder first (e.g. transformers' from_pretrained(folder, gguf_file=...).save_pretrained)")
        if is_ir_folder(src.folder):
            if config.quantization in OPENVINO_QUANTIZATIONS:
                raise ConfigError(f"quantization {config.quantization!r} applies when exporting; {config.model} "
                                  "is already OpenVINO IR (export it again from its Hugging Face folder)")
            ir = src.folder
        else:
            ir = export_ir(src.folder, weight_format(config.dtype, config.quantization), config.trust_remote_code)
        self.model_config = hf = model_loader.load_config(src)
        config.finalize(getattr(hf, "max_position_embeddings", None) or 2048)
        self.max_model_len: int = config.max_model_len  # type: ignore[assignment]
        self.tokenizer = model_loader.load_tokenizer(src, config.tokenizer)
        if config.chat_template:
            self.tokenizer.chat_template = config.chat_template

        dtype, kv_dtype = resolve_dtypes(config)
        if config.kv_cache_space is None:  # (sized as the torch backend sizes it, from the checkpoint)
            from armserve.engine.memory_plan import plan_memory

            plan_memory(config, src, hf, dtype, kv_dtype)
        precision, kv_precision = (_PRECISIONS[t] for t in (dtype, kv_dtype))
        threads, cores = thread_settings()
        if cores is not None:
            # OpenVINO's CPU plugin keeps its threads within the process's affinity mask.
            os.sched_setaffinity(0, cores)
        properties = {"INFERENCE_NUM_THREADS": threads, "INFERENCE_PRECISION_HINT": precision,
                      "KV_CACHE_PRECISION": kv_precision, "ENABLE_CPU_PINNING": cores is not None}
        sched = genai.SchedulerConfig()
        self.num_kv_blocks = self._num_kv_blocks(hf, config.kv_cache_space, kv_precision)  # type: ignore[arg-type]
        sched.num_kv_blocks = self.num_kv_blocks
        sched.cache_size = 0
        sched.enable_prefix_caching = config.enable_prefix_caching
        sched.max_num_batched_tokens = config.max_num_batched_tokens
        sched.max_num_seqs = config.max_num_seqs
        sched.dynamic_split_fuse = True  # chunked prefill, as armserve's own scheduler
        self.pipe = genai.ContinuousBatchingPipeline(ir, sched, "CPU", properties)
        self.ir_folder = ir

        self.eos_token_ids = model_loader.eos_token_ids(src, self.tokenizer)
        self.vocab_size = hf.vocab_size
        self.kv_block_size = OV_CPU_BLOCK_SIZE
        self._requests: dict[str, _Request] = {}
        self._ov_ids = itertools.count()
        self._rng = random.Random(config.seed)
        logger.info("loaded %s on OpenVINO %s from %s in %.1fs: precision %s, KV cache %s %d blocks x %d tokens, "
                    "max_model_len %d, %d threads%s", config.model, genai.__version__, ir, time.time() - t0,
                    precision, kv_precision, self.num_kv_blocks, OV_CPU_BLOCK_SIZE, self.max_model_len, threads,
                    f" pinned to {cores}" if cores else "")

    @staticmethod
    def _check_config(config: EngineConfig) -> None:
        """Engine arguments this backend cannot honour, refused by name."""
        if config.tensor_parallel_size != 1:
            raise ConfigError("tensor_parallel_size > 1 is not supported by the openvino backend")
        if config.block_size != OV_CPU_BLOCK_SIZE:
            raise ConfigError(f"block_size {config.block_size} is not supported by the openvino backend "
                              f"(its CPU cache pages {OV_CPU_BLOCK_SIZE} tokens)")
        if config.enforce_eager:
            raise ConfigError("enforce_eager is not supported by the openvino backend (it has no step graphs "
                              "to turn off)")
        if resolve_dtype(config.dtype) not in (torch.float32, torch.bfloat16):
            raise ConfigError(f"dtype {config.dtype!r} is not supported by the openvino backend; use float32 or "
                              "bfloat16")
        if config.quantization == "none":
            raise ConfigError("quantization 'none' (dequantize a quantized checkpoint) is not supported by the "
                              "openvino backend; leave it unset, or use int8/int4")

    @staticmethod
    def _num_kv_blocks(hf, gib: float, kv_precision: str) -> int:
        """How many 32-token blocks `gib` GiB of cache holds. A u8 row also carries a scale and a
        zero point (float32) per head."""
        heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        elem = {"f32": 4, "bf16": 2, "u8": 1}[kv_precision]
        per_head = head_dim * elem + (8 if kv_precision == "u8" else 0)
        per_token = 2 * hf.num_hidden_layers * heads * per_head
        blocks = int(gib * 2**30 // (per_token * OV_CPU_BLOCK_SIZE))
        if blocks < 1:
            raise ConfigError(f"kv_cache_space {gib} GiB holds no block of {OV_CPU_BLOCK_SIZE} tokens for this "
                              "model; raise it")
        return blocks

    # ---- admission --------------------------------------------------------------------------

    def generation_config(self, params: SamplingParams, max_tokens: int):
        """The pipeline's GenerationConfig for `params`; ValueError naming what it cannot carry."""
        def refuse(name: str, why: str) -> None:
            raise ValueError(f"{name} is not supported by the openvino backend: {why}")

        if params.structured_outputs is not None:
            refuse("structured_outputs", "use backend='torch' for JSON schema, regex, choice and grammar outputs")
        if params.prompt_logprobs is not None:
            refuse("prompt_logprobs", "the pipeline does not return prompt log-probabilities")
        if params.logprobs is not None and params.logprobs > 0:
            refuse("logprobs", f"the pipeline returns only the chosen token's log-probability (logprobs=0), "
                               f"not the top {params.logprobs} alternatives")
        if params.greedy and params.n > 1:
            refuse("n", "n > 1 needs temperature > 0 (the pipeline samples several sequences only at random)")
        g = self._genai.GenerationConfig()
        g.max_new_tokens = max_tokens
        g.min_new_tokens = params.min_tokens
        # NOTE: the pipeline's ignore_eos also ignores stop_token_ids (vLLM's does not): with
        # ignore_eos, `_read` matches the user's stop ids itself.
        if params.ignore_eos:
            g.ignore_eos = True
        else:
            eos = sorted(self.eos_token_ids)
            if eos:
                g.eos_token_id = eos[0]  # the pipeline wants it among the stop ids
            g.stop_token_ids = set(params.stop_token_ids or []) | self.eos_token_ids
        # NOTE: stop strings are matched by armserve's detokenizer (engine/detokenizer.py), exactly
        # as on the torch backend; the request is cancelled when one appears.
        g.repetition_penalty = params.repetition_penalty
        g.presence_penalty = params.presence_penalty
        g.frequency_penalty = params.frequency_penalty
        if params.greedy:
            g.do_sample = False
        else:
            g.do_sample = True
            g.temperature = params.temperature
            g.top_p = params.top_p
            if params.top_k > 0:
                g.top_k = params.top_k
            g.min_p = params.min_p
            g.num_return_sequences = params.n
            # A request without a seed draws one from the engine's generator (seeded by `seed`).
            g.rng_seed = params.seed if params.seed is not None else self._rng.getrandbits(32)
        if params.logprobs is not None:
            g.logprobs = 1
        try:
            g.validate()
        except Exception as e:  # the pipeline's own check, e.g. a value out of its range
            raise ValueError(f"the openvino backend refuses these sampling parameters: {str(e).strip()}") from None
        return g

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a processed request; ValueError naming what the pipeline cannot carry, backend untouched."""
        import numpy as np
        import openvino as ov

        params = request.params
        gen = self.generation_config(params, request.max_tokens)
        ov_id = next(self._ov_ids)
        handle = self.pipe.add_request(ov_id, ov.Tensor(np.array([request.prompt_token_ids], dtype=np.int64)), gen)
        self._requests[request.request_id] = _Request(request.request_id, len(request.prompt_token_ids), params,
                                                      handle, [0] * params.n)

    def abort_request(self, request_id: str, indices: Sequence[int] | None = None) -> None:
        """Stop sequences now; the request's cache is freed once none is left. Unknown ids are ignored."""
        req = self._requests.get(request_id)
        if req is None:
            return
        req.done.update(range(req.params.n) if indices is None else indices)
        if len(req.done) == req.params.n:
            # (a stop string ended it while the pipeline still runs it: free its cache now)
            req.handle.cancel()
            del self._requests[request_id]
            self._flush()

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def step(self) -> BackendOutput:
        """One pipeline step, then each request's new tokens."""
        out = BackendOutput()
        if not self._requests:
            return out
        self.pipe.step()
        status = self._genai.GenerationStatus
        for rid, req in list(self._requests.items()):
            out.scheduled[rid] = 0  # (the pipeline does not report prefix-cache hits)
            while req.handle.can_read():
                for seq_id, res in req.handle.read().items():
                    seq = self._read(req, seq_id, res)
                    if seq is not None:
                        if seq.token_ids and not req.got_tokens:
                            req.got_tokens = True
                            out.num_prompt_tokens += req.num_prompt_tokens
                        out.sequences.append(seq)
            st = req.handle.get_status()
            if st == status.IGNORED:
                # Admission checks that the request fits the cache; this is the pipeline refusing anyway.
                logger.warning("the openvino pipeline dropped request %s (no room in its KV cache)", rid)
            if st != status.RUNNING:
                reason = "abort" if st in (status.IGNORED, status.CANCEL) else "stop"
                out.sequences += [SequenceOutput(rid, i, [], finish_reason=reason)
                                  for i in range(req.params.n) if i not in req.done]
                del self._requests[rid]
            elif len(req.done) == req.params.n:
                req.handle.cancel()  # (its stop ids ended it, which the pipeline ignores: see _read)
                del self._requests[rid]
        self._flush()
        return out

    def _flush(self) -> None:
        """Let the pipeline drop cancelled requests (it does so in a step) when none of ours is
        left to step it, so their blocks go back to its cache now."""
        if not self._requests and self.pipe.has_non_finished_requests():
            self.pipe.step()

    def _read(self, req: _Request, seq_id: int, res) -> SequenceOutput | None:
        """One sequence's new tokens as read from the pipeline; None if it has ended."""
        idx = req.seq_index.setdefault(seq_id, len(req.seq_index))
        if idx in req.done:
            return None
        params = req.params
        toks = list(res.generated_ids)
        lps = list(res.generated_log_probs)
        reason = self._genai.GenerationFinishReason
        seq = SequenceOutput(req.request_id, idx, toks)
        for i, tok in enumerate(toks):
            req.num_tokens[idx] += 1
            last = i == len(toks) - 1
            # (with ignore_eos the user's stop ids are matched here: see generation_config)
            if (last and res.finish_reason == reason.STOP) or (
                    params.ignore_eos and tok in params.stop_token_ids  # type: ignore[operator]
                    and req.num_tokens[idx] >= params.min_tokens):
                del toks[i + 1:]
                seq.finish_reason = "stop"
                seq.stop_reason = tok if tok in (params.stop_token_ids or []) else None
            elif last and res.finish_reason == reason.LENGTH:
                seq.finish_reason = "length"
            if seq.finish_reason is not None:
                req.done.add(idx)
                break
        if params.logprobs is not None:
            # NOTE: the pipeline reports only the chosen token: its rank is 1 under greedy
            # decoding and not known when sampling (0).
            rank = 1 if params.greedy else 0
            seq.logprobs = [([tok], [lp], rank) for tok, lp in zip(toks, lps)]
        return seq if toks or seq.finish_reason is not None else None

    def warm_up(self) -> None:
        """One dummy prefill of up to 512 tokens and a decode step."""
        n = min(self.config.max_num_batched_tokens, self.max_model_len - 2, 512)  # type: ignore[type-var]
        run_dummy_request(self, n)

    def release_idle_memory(self) -> None:
        """Nothing: the pipeline keeps its own buffers."""

    def scheduler_stats(self) -> SchedulerStats:
        """Requests and KV cache use as the pipeline reports them. NOTE: the pipeline does not
        report prefix-cache hits or preemptions; those counters stay 0."""
        m = self.pipe.get_metrics()
        usage = m.cache_usage / 100.0  # the pipeline reports percent
        return SchedulerStats(
            num_running=min(m.scheduled_requests, len(self._requests)),
            num_waiting=max(0, len(self._requests) - m.scheduled_requests),
            kv_cache_usage=usage,
            kv_blocks_used=round(usage * self.num_kv_blocks),
            kv_blocks_total=self.num_kv_blocks,
        )


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(prog="python -m armserve.engine.openvino_backend",
                                 description="The OpenVINO backend's exporter environment.")
    ap.add_argument("--install-exporter", action="store_true", required=True,
                    help="make (or update) the exporter's environment for this Python environment")
    ap.add_argument("--verbose", action="store_true", help="show pip's progress")
    args = ap.parse_args()
    install_exporter(quiet=not args.verbose)
