"""End to end under qemu-aarch64 (scripts/ci_arm64.sh): armserve's engine, with the aarch64 kernels on,
generates the same greedy tokens for a tiny random Llama as the x86 run did (tests_arm/e2e_reference.py,
whose JSON ARMSERVE_E2E_REFERENCE names). Every variant this CPU runs is checked (or those of them that
ARMSERVE_ARM_ISAS names), and each must have gone through every kernel family, not the PyTorch path.
"""

from __future__ import annotations

import json
import os

EXPECT_CPU = os.environ.get("ARMSERVE_EXPECT_CPU", "")
REFERENCE = os.environ.get("ARMSERVE_E2E_REFERENCE", "")
WANTED_ISAS = os.environ.get("ARMSERVE_ARM_ISAS", "").split()  # empty: every variant the CPU runs
if os.uname().machine != "aarch64" or not EXPECT_CPU or not os.path.isfile(REFERENCE):
    raise RuntimeError("tests_arm/ runs only under qemu-aarch64 from scripts/ci_arm64.sh "
                       "(ARMSERVE_EXPECT_CPU, ARMSERVE_E2E_REFERENCE)")

import torch  # noqa: E402

from armserve import LLM, SamplingParams, kernels  # noqa: E402
from armserve.kernels import attention, elementwise  # noqa: E402

KERNELS = ["rms_norm", "rotary", "act_and_mul", "reshape_and_cache", "paged_attention"]


def test_greedy_tokens_equal_x86(monkeypatch):
    with open(REFERENCE) as f:
        ref = json.load(f)
    torch.set_num_threads(2)
    llm = LLM(ref["model"], **ref["engine_args"])
    assert llm.llm_engine.runner.use_kernels, kernels.load_error()
    wheel_library = os.environ.get("ARMSERVE_EXPECT_LIBRARY")  # the prebuilt wheel's (scripts/ci_wheels.sh)
    if wheel_library:
        assert kernels.library_path() == wheel_library, kernels.library_path()
        assert kernels.compiled_variants() == ["scalar", "neon", "sve"], kernels.compiled_variants()
        # the only OpenMP runtime in the process is torch's (the rootfs has no libgomp)
        assert len(kernels.openmp_runtimes()) == 1 and "torch" in kernels.openmp_library(), kernels.openmp_runtimes()

    # Counted where the ops call into the library: an op that fell back to PyTorch is not counted.
    calls = dict.fromkeys(KERNELS, 0)
    for module in (elementwise, attention):
        def counted(name, *args, _call=module.call):
            if name.removeprefix("armserve_") in calls:
                calls[name.removeprefix("armserve_")] += 1
            return _call(name, *args)

        monkeypatch.setattr(module, "call", counted)

    params = SamplingParams(temperature=0.0, max_tokens=ref["max_tokens"], ignore_eos=True)
    isas = kernels.supported_isas()
    assert isas[-1] == kernels.isa() and isas[-1] in ("neon", "sve"), (isas, kernels.isa())
    assert set(WANTED_ISAS) <= set(isas), (WANTED_ISAS, isas)
    before = kernels.isa()
    try:
        for isa in reversed(isas):  # the CPU's best variant first
            if WANTED_ISAS and isa not in WANTED_ISAS:
                continue
            kernels.select_isa(isa)
            for k in calls:
                calls[k] = 0
            outs = llm.generate(ref["prompts"], params, use_tqdm=False)
            assert [o.prompt_token_ids for o in outs] == ref["prompt_token_ids"]
            got = [o.outputs[0].token_ids for o in outs]
            assert got == ref["token_ids"], (isa, got, ref["token_ids"])
            assert all(calls.values()), (isa, calls)
            # One prompt alone: its decode steps are batch-1 step graphs (recorded, then replayed
            # by csrc/graph.cpp on this CPU), and must still give the x86 run's tokens.
            graphs = llm.llm_engine.runner.graphs
            replays = graphs.replays
            alone = llm.generate([{"prompt_token_ids": ref["prompt_token_ids"][0]}], params, use_tqdm=False)
            assert alone[0].outputs[0].token_ids == ref["token_ids"][0], (isa, "batch-1 graph")
            # (float32 matmuls run the dense float32 GEMM on every variant, the scalar one too)
            assert graphs.replays > replays, (isa, graphs.replays - replays)
            print(f"-cpu {EXPECT_CPU} {isa}: tokens equal to x86 ({ref['x86_isa']}); kernel calls {calls}; "
                  f"{graphs.replays - replays} step-graph replays")
    finally:
        kernels.select_isa(before)
