"""Smoke check of an installed x86_64 wheel (scripts/ci_wheels.sh), run by the Python of a fresh
virtualenv holding only the wheel and its dependencies, on a PATH without any compiler:

    python scripts/wheel_smoke.py REFERENCE.json

The kernels must come from the wheel's library, carry every x86 variant, run the best one this CPU
has (AVX-512 or AVX2) on torch's OpenMP runtime alone, and generate the greedy tokens that the source
build gave for the same tiny random Llama (REFERENCE.json, written by tests_arm/e2e_reference.py).
"""

from __future__ import annotations

import json
import os
import shutil
import sys


def main(ref_path: str) -> None:
    compilers = {c: shutil.which(c) for c in ("g++", "gcc", "cc", "c++", "clang")}
    assert not any(compilers.values()), f"a compiler is on PATH: {compilers}"

    import armserve
    from armserve import LLM, SamplingParams, kernels

    here = os.path.realpath(sys.prefix)
    assert os.path.realpath(armserve.__file__).startswith(here), f"armserve not from this venv: {armserve.__file__}"
    lib = kernels.library_path()
    assert lib is not None and os.path.realpath(lib) == os.path.join(os.path.dirname(os.path.realpath(
        armserve.__file__)), "_C.so"), f"not the wheel's library: {lib}"
    assert kernels.available(), kernels.fallback_notice()
    assert kernels.compiled_variants() == ["scalar", "avx2", "avx512", "amx_bf16"], kernels.compiled_variants()
    best = kernels.supported_isas()[-1]
    assert kernels.isa() == best and best in ("avx512", "avx2"), (kernels.isa(), kernels.supported_isas())
    runtimes = kernels.openmp_runtimes()
    assert len(runtimes) == 1 and runtimes[0] == kernels.openmp_library(), runtimes  # torch's, nothing else

    with open(ref_path) as f:
        ref = json.load(f)
    llm = LLM(ref["model"], **ref["engine_args"])
    assert llm.llm_engine.runner.use_kernels, kernels.load_error()
    params = SamplingParams(temperature=0.0, max_tokens=ref["max_tokens"], ignore_eos=True)
    outs = llm.generate(ref["prompts"], params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == ref["prompt_token_ids"]
    got = [o.outputs[0].token_ids for o in outs]
    assert got == ref["token_ids"], (got, ref["token_ids"])
    print(f"wheel smoke: {lib} ({', '.join(kernels.compiled_variants())}), {kernels.isa()} in use, OpenMP "
          f"{runtimes[0]}; greedy tokens equal to the source build's ({ref['x86_isa']}): {got}")


if __name__ == "__main__":
    main(sys.argv[1])
