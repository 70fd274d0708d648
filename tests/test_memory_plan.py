"""The memory plan (engine/memory_plan.py) from metadata alone, against transformers' own count of
the model's parameters; the KV cache default (vLLM's CPU rule, config.py) and the error of a given
KV space that does not fit the machine; malloc keeping freed memory (memory.keep_freed_memory)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from armserve.config import DEFAULT_KV_CACHE_MEMORY_FRACTION, ConfigError, EngineConfig
from armserve.engine.memory_plan import plan_memory
from armserve.memory import available_memory, total_memory
from armserve.model_source import resolve_model_path


def _plan(model: str, **kwargs):
    from armserve import model_loader

    cfg = EngineConfig(model=model, dtype="float32", **kwargs).for_serving()
    src = resolve_model_path(model)
    hf = model_loader.load_config(src)
    cfg.finalize(hf.max_position_embeddings)
    return cfg, hf, plan_memory(cfg, src, hf, torch.float32, torch.float32)


def test_plan_counts_weights_by_kind_and_kv_per_token(tiny_llama):
    """Weights by kind add up to transformers' parameters (float32), the embedding and head apart;
    KV bytes per token are K and V of every KV head in every layer."""
    from transformers import AutoModelForCausalLM

    cfg, hf, plan = _plan(tiny_llama, kv_cache_space=0.01, max_model_len=64)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    params = dict(model.named_parameters())
    embed = params["model.embed_tokens.weight"].numel() * 4
    head = model.lm_head.weight.numel() * 4  # (tied or not, the engine holds the head's own layout)
    total = sum(p.numel() for n, p in params.items()) * 4 + (head if hf.tie_word_embeddings else 0)
    assert plan.weights["embedding"] == embed
    assert plan.weights["head"] == head
    assert plan.weights["quantized"] == 0
    assert sum(plan.weights.values()) == total
    head_dim = hf.hidden_size // hf.num_attention_heads
    assert plan.kv_bytes_per_token == hf.num_hidden_layers * 2 * hf.num_key_value_heads * head_dim * 4
    assert plan.kv_space == int(0.01 * 2**30) and plan.kv_tokens == plan.kv_space // plan.kv_bytes_per_token
    assert plan.total == sum(plan.weights.values()) + plan.kv_space + plan.runtime


def test_default_kv_space_follows_vllm_cpu_rule(tiny_llama):
    """Unset: at most half the node's memory and half of what is available, and no more than
    max_num_seqs full-length sequences use; the chosen space is written into the config."""
    cfg, _, plan = _plan(tiny_llama, max_model_len=64, max_num_seqs=4)
    assert cfg.kv_cache_space == plan.kv_space / 2**30
    assert plan.kv_space <= DEFAULT_KV_CACHE_MEMORY_FRACTION * total_memory()
    assert plan.kv_space <= 4 * 64 * plan.kv_bytes_per_token  # 4 sequences of 64 tokens
    assert plan.kv_tokens >= 64
    assert "default" in plan.kv_source


def test_kv_space_that_does_not_fit_is_refused_with_the_numbers(tiny_llama):
    too_big = 2 * available_memory() / 2**30
    with pytest.raises(ConfigError, match=r"does not fit: weights .* GiB \+ KV cache .* GiB .* available"):
        _plan(tiny_llama, kv_cache_space=too_big)


def test_armserve_info_prints_the_plan(tiny_llama, capsys):
    from armserve.cli import main

    assert main(["info", "--json", "--model", tiny_llama, "--dtype", "float32", "--kv-cache-space", "0.01",
                 "--max-model-len", "64"]) == 0
    info = json.loads(capsys.readouterr().out)["kv_cache"]
    plan = info["memory_plan"]
    assert info["max_model_len"] == 64
    assert set(plan["weights"]) == {"dense", "quantized", "embedding", "head"}
    assert plan["total"] == plan["weights_total"] + plan["kv_space"] + plan["runtime"]
    assert plan["kv_bytes_per_token"] == info["bytes_per_token"]


def test_auto_dtype_of_a_quantized_gguf_is_bfloat16_on_every_cpu(smollm2_gguf, capsys):
    """dtype auto keeps a quantized GGUF's KV cache in 16 bits whatever the CPU (its layers quantize
    their activations to int8 anyway); dequantized, the GGUF follows the CPU rule as a dense model."""
    from armserve.cli import main
    from armserve.dtypes import resolve_dtype

    def kv(*extra: str) -> dict:
        assert main(["info", "--json", "--model", smollm2_gguf, "--kv-cache-space", "0.01", *extra]) == 0
        return json.loads(capsys.readouterr().out)["kv_cache"]

    # SmolLM2: 30 layers x 3 KV heads x 64 values, for K and V
    assert kv()["dtype"] == "bfloat16" and kv()["bytes_per_token"] == 2 * 30 * 3 * 64 * 2
    assert kv("--quantization", "none")["dtype"] == str(resolve_dtype("auto")).removeprefix("torch.")
    assert kv("--dtype", "float32")["dtype"] == "float32"


def test_kv_cache_dtype_bfloat16_runs_the_model_in_bfloat16(tiny_llama):
    """vLLM's `kv_cache_dtype="bfloat16"`: the cache (stored in the model dtype) and so the model in
    bfloat16, whatever `auto` picks on this CPU; with another explicit dtype, a ConfigError naming it."""
    from armserve.dtypes import resolve_dtypes

    cfg = EngineConfig(model=tiny_llama, kv_cache_dtype="bfloat16")
    assert resolve_dtypes(cfg, torch.float32) == (torch.bfloat16, torch.bfloat16)
    assert resolve_dtypes(EngineConfig(model=tiny_llama, dtype="bfloat16", kv_cache_dtype="BFloat16"))[1] == torch.bfloat16
    with pytest.raises(ConfigError, match="kv_cache_dtype 'bfloat16' needs the model in bfloat16.*float32"):
        EngineConfig(model=tiny_llama, dtype="float32", kv_cache_dtype="bfloat16")


# Two 12 MiB activations allocated, touched and freed per "layer", as an encoder step does.
_FAULTS_SCRIPT = """
import ctypes, resource, sys
from armserve.memory import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else False
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
n = 12 << 20
def layer():
    a = libc.malloc(n); ctypes.memset(a, 1, n)
    b = libc.malloc(n); ctypes.memset(b, 1, n)
    libc.free(a); libc.free(b)
layer()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10): layer()
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _layer_faults(mode: str, **env: str) -> tuple[bool, int]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", _FAULTS_SCRIPT, mode], env={**clean, **env}, check=True,
                         capture_output=True, text=True).stdout.split()
    return out[0] == "True", int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_keep_freed_memory_stops_the_page_faults_of_each_layer():
    """glibc's defaults hand such blocks back and fault them in again every layer; kept, they are
    reused. An environment that tunes malloc itself is left alone."""
    kept, faults = _layer_faults("keep")
    _, default_faults = _layer_faults("default")
    assert default_faults > 10 * 3072  # (glibc's behaviour the function is for: 2 x 3072 pages a layer)
    assert kept and faults < 1000, faults
    assert not _layer_faults("keep", MALLOC_TRIM_THRESHOLD_="100000")[0]


def _thp_eligible(address: int) -> int:
    """The THPeligible flag of the mapping holding `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "THPeligible:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"), reason="Linux THP")
@pytest.mark.parametrize("switch", ["1", "0"])
def test_kv_cache_huge_pages_follow_the_thp_switch(monkeypatch, switch):
    """The KV cache is advised onto huge pages unless THP_MEM_ALLOC_ENABLE=0 (the switch PyTorch
    reads for its own allocations) opts the engine out; the kernel's mode decides the rest: under
    "madvise" the advice alone makes the cache eligible, under "always" it is anyway, under
    "never" it never is. The buffer is mapped here, not allocated by PyTorch, whose own advice would
    otherwise decide (private and anonymous, as the allocator's pages are)."""
    import mmap

    from armserve.engine.model_runner import _HUGE_PAGE, _thp_mode, prefault_kv_cache

    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", switch)
    monkeypatch.delenv("ARMSERVE_KV_PREFAULT", raising=False)
    buf = mmap.mmap(-1, 8 * _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # (a shared one is shmem)
    cache = torch.frombuffer(buf, dtype=torch.uint8)
    cache.fill_(7)
    prefault_kv_cache(cache)
    assert int(cache.max()) == 0  # written once, with zeros
    mode = _thp_mode()
    expected = {"always": 1, "madvise": int(switch == "1")}.get(mode, 0)
    aligned = -(-cache.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE
    assert _thp_eligible(aligned) == expected, mode
    del cache
    buf.close()


_PAGE_OUT_SCRIPT = r"""
import ctypes, os, shutil, sys, tempfile
from armserve.kernels import library
from armserve.memory import page_out_library_code

src = library._library_path()
library.load()  # (the OpenMP runtime the library links against, loaded globally first)
copy = os.path.join(tempfile.mkdtemp(), "libpageout_copy.so")  # mapped by this process alone
shutil.copy(src, copy)
lib = ctypes.CDLL(copy)

def mappings():
    out, cur = [], None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and ":" not in head[0]:
                cur = None
                if len(head) >= 6 and head[5] == copy:
                    lo, hi = (int(x, 16) for x in head[0].split("-"))
                    cur = [lo, hi, head[1], 0]
                    out.append(cur)
            elif cur is not None and head[0] == "Rss:":
                cur[3] = int(head[1]) * 1024
    return out

for lo, hi, perms, _ in mappings():  # every page of the read-only mappings resident
    if "r" in perms and "w" not in perms:
        ctypes.string_at(lo, hi - lo)
before = sum(m[3] for m in mappings() if "w" not in m[2])
page_out_library_code()
after = sum(m[3] for m in mappings() if "w" not in m[2])
lib.armserve_exports.restype = ctypes.c_char_p
print(before, after, lib.armserve_exports().decode() == library.load().armserve_exports().decode())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_PAGEOUT), Linux 5.4")
def test_page_out_library_code_hands_back_a_libraries_pages_and_it_still_runs():
    """The engine core pages out its libraries' code after the load (libtorch's import-time code is
    ~60 MiB of its RSS): a library mapped by this process alone, every page made resident, keeps
    few of them, and its code runs afterwards from pages faulted back in."""
    out = subprocess.run([sys.executable, "-c", _PAGE_OUT_SCRIPT], check=True, capture_output=True, text=True,
                         timeout=120).stdout.split()
    before, after, same = int(out[0]), int(out[1]), out[2]
    assert before > 1 << 20, before  # (the kernels' library: ~1.7 MB of code and tables)
    assert after < before // 4, (before, after)
    assert same == "True"


_IDLE_TRIM_SCRIPT = r"""
import json

import armserve.memory as memory
from armserve.memory import IdleTrim, resident_bytes

clock = [0.0]
memory.time.monotonic = lambda: clock[0]  # (this process's: the test reads no real clock)


def freed_but_held(n):
    # n blocks of ~2 kB that malloc keeps in its heap (below its mmap threshold), all freed but
    # every 50th, which pins the heap's top: the freed blocks stay resident until a trim
    blocks = [bytes(2000) + bytes([i % 256]) for i in range(n)]
    pins = blocks[::50]
    del blocks
    return pins


released = []  # the clock at each call of `release` (the step scratch's hand-back)
trim = IdleTrim(growth=32 << 20, delay=2.0, release=lambda: released.append(clock[0]))
start = trim()  # nothing ran yet: nothing pending
keep = [freed_but_held(60_000)]  # ~120 MB: past the growth mark
trim.worked()
grown = resident_bytes()
at_once = trim()
big = grown - resident_bytes()
keep.append(freed_but_held(8_000))  # ~16 MB: below the mark
trim.worked()
clock[0] = 10.0
waits = [trim()]
clock[0] = 11.0
waits.append(trim())
held = resident_bytes()
trims_before = trim.trims
clock[0] = 12.0
waits.append(trim())
small = held - resident_bytes()
clock[0] = 20.0
waits.append(trim())
print(json.dumps([start, at_once, big, waits, trims_before, small, trim.trims, released]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_idle_trim_hands_back_a_freed_heap_at_once_when_it_grew_else_after_the_delay():
    """An idle engine core (engine/core.py) trims its heap at once when its RSS grew by the mark
    since the last trim (~120 MB freed but held in malloc's heap goes back), and once it has been
    idle for the delay after a step (~16 MB goes back then, not before), handing back its step
    scratch (`release`) then only; once per idle period."""
    out = subprocess.run([sys.executable, "-c", _IDLE_TRIM_SCRIPT], check=True, capture_output=True, text=True,
                         timeout=120).stdout
    start, at_once, big, waits, trims_before, small, trims, released = json.loads(out)
    assert start is None, out  # (nothing ran yet: nothing pending)
    assert at_once == 2.0, out  # (the heap now; the idle trim, with the scratch, still due in 2 s)
    assert big > 80 << 20, out
    assert waits == [2.0, 1.0, None, None], out  # (due in 2 s, then 1 s; trimmed; nothing pending)
    assert trims_before == 1, out  # (the growth's trim only: none before the delay)
    assert small > 8 << 20, out
    assert trims == 2, out
    assert released == [12.0], out  # (the step scratch with the idle trim only, once)
