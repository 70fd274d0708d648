"""x86 side of the aarch64 end-to-end check (scripts/ci_arm64.sh): make the tiny random Llama of the
`tiny_llama` test fixture (transformers, real SmolLM2 tokenizer), generate greedy tokens with armserve
on this machine, and write them to the JSON file given as argument. tests_arm/test_arm_e2e.py then runs
the same requests under emulated aarch64 and must produce the same tokens.

    python3 tests_arm/e2e_reference.py OUT.json
"""

from __future__ import annotations

import json
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import conftest  # noqa: E402  (the test suite's checkpoint recipe and cache)

PROMPTS = ["the cat sat on", "a b c d e f g h i j k l m n o p q r s t u v"]
ENGINE_ARGS = dict(dtype="float32", kv_cache_space=0.02)
MAX_TOKENS = 16


def tokenizer_dir() -> str:
    """conftest's `tokenizer_dir` fixture (SmolLM2's tokenizer as an HF folder), outside pytest."""
    out = os.path.join(conftest.CACHE, "smollm2-tokenizer")
    if not os.path.isfile(os.path.join(out, "tokenizer.json")):
        from transformers import AutoTokenizer

        folder, name = os.path.split(conftest.smollm2_gguf_path())
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        tmp = out + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tok.save_pretrained(tmp)
        os.replace(tmp, out)
    return out


def main(out_path: str) -> None:
    from armserve import LLM, SamplingParams, kernels

    model = conftest.make_tiny_checkpoint(
        os.path.join(conftest.CACHE, "tiny-llama"), "LlamaForCausalLM", tokenizer_dir()
    )
    llm = LLM(model, **ENGINE_ARGS)
    assert llm.llm_engine.runner.use_kernels, f"x86 kernels are off: {kernels.load_error()}"
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    ref = {
        "model": os.path.abspath(model),
        "engine_args": ENGINE_ARGS,
        "max_tokens": MAX_TOKENS,
        "prompts": PROMPTS,
        "prompt_token_ids": [o.prompt_token_ids for o in outs],
        "token_ids": [o.outputs[0].token_ids for o in outs],
        "x86_isa": kernels.isa(),
    }
    with open(out_path, "w") as f:
        json.dump(ref, f)
    print(f"x86 reference ({ref['x86_isa']} kernels): {ref['token_ids']}")


if __name__ == "__main__":
    main(sys.argv[1])
