"""The ISA-sensitive test files once more under every other kernel variant this CPU can run, forced
with `ARMSERVE_ISA` in a fresh process.

A forced variant stands for the CPUs it is built for in every decision (bf16 dot instructions,
native bfloat16 and so `dtype="auto"`, matmul token limits, which steps replay from step graphs),
so `ARMSERVE_ISA=avx2` on an AVX-512 machine runs what an AVX2-only CPU runs. The kernel tests
already cover every variant through the `isa` fixture; these files pick the variant once, at
import, like the engine does. Their tests that no variant can change run once, in the suite itself;
their real-model tests take the same paths there with fewer tokens (conftest.FORCED_RERUN).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import test_step_graph as step_graph
from conftest import kernel_isas

HERE = os.path.dirname(os.path.abspath(__file__))
FILES = ["test_step_graph.py", "test_engine.py", "test_models.py"]
# Tests of those files that run once, in the suite itself: those no variant changes (argument,
# config and loader checks and the capture guard, all Python; csrc/graph.cpp's elementwise ops,
# compiled once with no ISA flags), and one whose every ISA path the forced runs check elsewhere.
RUN_ONCE = [
    "test_add_bias_matches_torch", "test_mul_cols_matches_torch", "test_embedding_gathers_rows",
    "test_cast_rounds_like_torch", "test_argmax_matches_torch_with_ties_nans_and_signed_zeros",
    "test_capture_notes_pytorch_compute_and_refuses_to_replay", "test_recording_leaves_dynamo_unimported",
    "test_enforce_eager_cli_flag",
    "test_bad_requests_are_refused_and_engine_keeps_working", "test_request_larger_than_the_whole_cache_is_refused",
    "test_bad_sampling_params_name_the_field", "test_bad_engine_arguments", "test_broken_model_folders",
    "test_chat_uses_the_template", "test_mistral_sliding_window_is_used", "test_gguf_load_prints_no_warnings",
    "test_gguf_file_is_parsed_once_per_load",
    # KV block accounting under aborts and preemption, and where stop strings, stop token ids,
    # max_tokens and min_tokens end a completion: engine bookkeeping in Python, whichever tokens
    # the variant's kernels pick (batch and seed invariance, which a variant can change, stay)
    "test_no_block_leaks_after_aborts_and_preemptions", "test_n_completions_and_stop_strings",
    "test_stop_token_ids_max_tokens_and_min_tokens", "test_a_deleted_llm_is_freed_at_once",
    # Real Gemma 3 in float32 against transformers: each kernel it runs (attention at head_dim 256,
    # GELU-tanh, sliding windows) is checked on every variant by test_kernels' `isa` fixture, a real
    # model in float32 against transformers on every variant by SmolLM2's test, and the real
    # Gemma 3 on every variant by its quantized perplexity test.
    "test_gemma3_gguf_matches_transformers",
]


# NOTE: each variant's run is one process on one thread (conftest), so the variants run side by
# side on a machine's two cores; the two-thread replays (test_step_graph) wait until they are all
# done and then run one variant at a time, since a two-thread team next to another process would
# measure nothing but the contention. Those replays run straight from test_step_graph's helpers
# (its test asserts with check_team_case, as this file does): a pytest process per variant around
# them only added an interpreter, the imports and the collection of FILES.
TWO_THREADS = "two_threads"


def _auto_isa() -> str:
    from armserve import kernels

    return kernels.isa()


VARIANTS = [v for v in kernel_isas() if v != _auto_isa()]


def _pytest(variant: str, keyword: str, log: str) -> tuple[subprocess.Popen, str]:
    # -o addopts=: one process per variant, not the suite's two xdist workers each
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-x", *FILES, "-k", keyword]
    with open(log, "w") as out:
        # The checkout's armserve, as the suite itself imports it (`python3 -m pytest` from the root puts
        # the root on sys.path; this child runs in tests/), not whatever copy is installed.
        path = os.pathsep.join(p for p in (os.path.dirname(HERE), os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "ARMSERVE_ISA": variant, "PYTHONPATH": path, "ARMSERVE_TEST_FORCED_RERUN": "1"}
        return subprocess.Popen(cmd, cwd=HERE, env=env, stdout=out, stderr=subprocess.STDOUT), log


def _finish(proc: subprocess.Popen, log: str) -> tuple[int, str]:
    try:
        # (a guard against a hang, not a time limit: ~4 minutes on a quiet machine, past 25 with the
        # suite's other worker beside it on a 2-core machine loaded 15 deep)
        code = proc.wait(3600)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
    with open(log) as f:
        return code, f.read()


@pytest.fixture(scope="module")
def forced_runs(tmp_path_factory, tiny_checkpoints, tiny_llama) -> dict[str, tuple[tuple[int, str], dict]]:
    """Per variant: (exit code, output) of its run of FILES without RUN_ONCE and the two-thread
    replays, then those replays' results per case (test_step_graph.TEAM_CASES)."""
    tmp = tmp_path_factory.mktemp("forced-isa")
    once = " or ".join(RUN_ONCE)
    side_by_side = {v: _pytest(v, f"not ({once} or {TWO_THREADS})", str(tmp / f"{v}.log")) for v in VARIANTS}
    runs = {v: _finish(*started) for v, started in side_by_side.items()}
    cases = step_graph.team_cases(tiny_checkpoints, step_graph.biased_copy(tiny_checkpoints["qwen2"]),
                                  step_graph.w4a8_copy(tiny_llama, str(tmp / "w4a8")))
    out = {}
    for v in VARIANTS:
        try:
            teams = step_graph.run_on_two_threads(cases, {**os.environ, "ARMSERVE_ISA": v})
        except AssertionError as e:  # the process failed: every case reports it
            teams = {case: {"error": str(e)} for case in step_graph.TEAM_CASES}
        out[v] = (runs[v], teams)
    return out


@pytest.mark.parametrize("variant", VARIANTS)
def test_isa_sensitive_files_pass_with_variant_forced(forced_runs, variant):
    (code, output), teams = forced_runs[variant]
    tail = "\n".join(output.splitlines()[-40:])
    assert code == 0, f"ARMSERVE_ISA={variant} pytest {' '.join(FILES)} failed:\n{tail}"
    # test_step_graph's two-thread replays under this variant, checked as that test checks them
    for case in step_graph.TEAM_CASES:
        step_graph.check_team_case(teams[case])
    env = {**os.environ, "ARMSERVE_ISA": variant}
    # The forced variant was really the one used (kernels raises on an unknown or unsupported name).
    check = subprocess.run([sys.executable, "-c", "from armserve import kernels; print(kernels.isa())"], env=env,
                           capture_output=True, text=True, timeout=300)
    assert check.stdout.strip() == variant, check.stderr
