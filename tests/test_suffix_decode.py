"""Suffix decoding: the suffix tree's drafts against a brute-force count of the same suffixes
(through appends and removals), the global cache across requests and its bound, the config, and
greedy outputs identical to decoding without speculation."""

from __future__ import annotations

import random

import pytest

from armserve import LLM, SamplingParams
from armserve.config import ConfigError, EngineConfig, SpeculativeConfig
from armserve.engine.request import Request
from armserve.engine.suffix_decode import SuffixProposer, SuffixTree

from test_spec_decode import _chain_prompts, _run, _spec_stats, markov_llama  # noqa: F401 (a fixture)


# ---- the tree against brute force -------------------------------------------------------------


def _brute_speculate(seqs: list[list[int]], depth: int, pattern: list[int], max_tokens: int, factor: float,
                     min_prob: float) -> tuple[list[int], float, int]:
    """The same draft from a plain count of every suffix cut to `depth` tokens."""
    suffixes = [tuple(s[i:i + depth]) for s in seqs for i in range(len(s))]

    def count(path: tuple[int, ...]) -> int:
        return sum(1 for x in suffixes if x[:len(path)] == path)

    best: tuple[list[int], float, int] = ([], 0.0, 0)
    for m in range(1, len(pattern)):
        path = tuple(pattern[len(pattern) - m:])
        if count(path) == 0:
            break
        cap = min(max_tokens, int(m * factor + 1e-6))
        toks: list[int] = []
        prob, score = 1.0, 0.0
        while len(toks) < cap:
            nexts = {x[len(path)] for x in suffixes if len(x) > len(path) and x[:len(path)] == path}
            if not nexts:
                break
            c, t = max((count(path + (t,)), -t) for t in nexts)
            prob *= c / count(path)
            if prob < min_prob:
                break
            t = -t
            toks.append(t)
            score += prob
            path += (t,)
        if score >= best[1] - 1e-9:
            best = (toks, score, m)
    return best


def _check(tree: SuffixTree, seqs: dict[int, list[int]], depth: int, rng: random.Random) -> None:
    live = list(seqs.values())
    for _ in range(25):
        src = rng.choice(live) if live and rng.random() < 0.8 else [rng.randrange(4) for _ in range(6)]
        cut = rng.randrange(1, len(src) + 1)
        pattern = src[max(0, cut - depth):cut] + ([rng.randrange(4)] if rng.random() < 0.3 else [])
        args = (rng.choice([1, 3, 8]), rng.choice([0.5, 1.0, 2.0]), rng.choice([0.0, 0.1, 0.4]))
        toks, score, m = tree.speculate(pattern, *args)
        want = _brute_speculate(live, depth, pattern, *args)
        assert (toks, m) == (want[0], want[2]) and score == pytest.approx(want[1]), (pattern, args)
    assert tree.root.count == sum(map(len, live))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tree_drafts_equal_brute_force(seed):
    rng = random.Random(seed)
    depth = rng.choice([3, 5, 8])
    tree = SuffixTree(depth)
    seqs: dict[int, list[int]] = {}
    for step in range(12):
        sid = rng.randrange(4)
        if sid in seqs and rng.random() < 0.3:
            tree.remove(sid)
            del seqs[sid]
        else:
            # repetitive text over a small alphabet: deep shared paths, splits and merges
            add = [rng.randrange(3 if rng.random() < 0.7 else 6) for _ in range(rng.randrange(1, 15))]
            if sid in seqs and rng.random() < 0.5:
                add = seqs[sid][:rng.randrange(1, len(seqs[sid]) + 1)] + add
            tree.extend(sid, add)
            seqs.setdefault(sid, []).extend(add)
        _check(tree, seqs, depth, rng)
    for sid in list(seqs):
        tree.remove(sid)
    assert tree.num_nodes() == 1 and tree.root.count == 0 and len(tree) == 0


def test_tree_draft_length_follows_the_match():
    tree = SuffixTree(24)
    text = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    tree.extend(0, text + [50, 51] + text[:4])
    # the suffix [1 2 3 4] (m = 4; the 1-3 token ones draft less) continues as before: 4 tokens
    assert tree.speculate([50, 51, 1, 2, 3, 4], 16, 1.0, 0.1)[0] == [5, 6, 7, 8]
    assert tree.speculate([50, 51, 1, 2, 3, 4], 16, 2.0, 0.1)[0] == [5, 6, 7, 8, 9, 10, 11, 12]
    assert tree.speculate([50, 51, 1, 2, 3, 4], 3, 2.0, 0.1)[0] == [5, 6, 7]
    assert tree.speculate([99, 98], 16, 1.0, 0.1) == ([], 0.0, 0)


# ---- the proposer: requests and the global cache ------------------------------------------------


def _proposer(**kw) -> SuffixProposer:
    return SuffixProposer(SpeculativeConfig("suffix", **kw))


def _serve(p: SuffixProposer, rid: str, prompt: list[int], output: list[int]) -> Request:
    """A request that proposed once after its prompt, wrote `output` and finished."""
    req = Request(rid, prompt, SamplingParams(temperature=0, max_tokens=100), 100)
    p.propose(req, 8)
    for t in output:
        req.append_output_token(t)
    p.finish(req)
    return req


def test_cross_request_cache_hits():
    p = _proposer(num_speculative_tokens=8, suffix_decoding_max_spec_factor=4.0)
    tool_call = [700, 701, 702, 703, 704, 705, 706, 707, 708]
    _serve(p, "a", [1, 2, 3], [9, 9] + tool_call)
    # another request with another prompt: its own tree knows nothing of the tool call
    req = Request("b", [4, 5, 6], SamplingParams(temperature=0, max_tokens=100), 100)
    assert p.propose(req, 8) == []
    for t in tool_call[:2]:
        req.append_output_token(t)
    assert p.propose(req, 8) == tool_call[2:2 + 8]
    assert p.propose(req, 3) == tool_call[2:5]
    none = _proposer(num_speculative_tokens=8, suffix_decoding_max_cached_requests=0)
    _serve(none, "a", [1, 2, 3], [9, 9] + tool_call)
    assert len(none.global_tree) == 0
    req2 = Request("c", [4, 5, 6] + tool_call[:2], SamplingParams(temperature=0, max_tokens=100), 100)
    assert none.propose(req2, 8) == []


def test_global_cache_is_bounded():
    p = _proposer(suffix_decoding_max_cached_requests=3, suffix_decoding_max_tree_depth=6)
    rng = random.Random(0)
    outputs = []
    for i in range(20):
        out = [rng.randrange(1000) for _ in range(30)]
        req = _serve(p, str(i), [1, 2], out)
        outputs.append(out)
        assert req.spec.suffix is None  # the request's own tree went with it
        assert len(p.cached) == min(i + 1, 3)
        assert len(p.global_tree) == 30 * min(i + 1, 3)
        assert p.global_tree.root.count == len(p.global_tree)
        # each cached token adds a suffix of at most two nodes, and nothing evicted stays
        assert p.global_tree.num_nodes() <= 1 + 2 * 30 * 3
    req = Request("x", [5] + outputs[-1][:3], SamplingParams(temperature=0, max_tokens=100), 100)
    assert p.propose(req, 4) == outputs[-1][3:6]  # (spec factor 1: 3 matched tokens draft 3)
    req = Request("y", [5] + outputs[0][:3], SamplingParams(temperature=0, max_tokens=100), 100)
    assert p.propose(req, 4) == []  # evicted


@pytest.mark.parametrize("value, words", [
    ({"method": "suffix", "suffix_decoding_max_tree_depth": 0}, "suffix_decoding_max_tree_depth"),
    ({"method": "suffix", "suffix_decoding_max_cached_requests": -1}, "suffix_decoding_max_cached_requests"),
    ({"method": "suffix", "suffix_decoding_max_spec_factor": -1.0}, "suffix_decoding_max_spec_factor"),
    ({"method": "suffix", "suffix_decoding_min_token_prob": 1.5}, "suffix_decoding_min_token_prob"),
    ({"method": "suffix", "suffix_decoding_min_token_prob": "x"}, "suffix_decoding_min_token_prob"),
    ({"method": "ngram", "suffix_decoding_max_tree_depth": 8}, "only apply to method 'suffix'"),
    ({"method": "suffix", "model": "m"}, "takes no draft 'model'"),
])
def test_bad_suffix_config_names_the_problem(value, words):
    with pytest.raises(ConfigError, match=words):
        EngineConfig(model="m", speculative_config=value)


def test_suffix_config_defaults():
    c = EngineConfig(model="m", speculative_config='{"method": "suffix"}').speculative_config
    # vLLM's, but for the cached requests (vLLM: 10000), which cost memory here
    assert (c.suffix_decoding_max_tree_depth, c.suffix_decoding_max_spec_factor,
            c.suffix_decoding_min_token_prob) == (24, 1.0, 0.1)
    assert 0 < c.suffix_decoding_max_cached_requests <= 10000
    # vLLM's too: suffix decoding drafts up to the tree depth unless told; other methods 4
    assert c.num_speculative_tokens == 24
    assert SpeculativeConfig("suffix", suffix_decoding_max_tree_depth=8).num_speculative_tokens == 8
    assert SpeculativeConfig("suffix", num_speculative_tokens=3).num_speculative_tokens == 3
    assert SpeculativeConfig("ngram").num_speculative_tokens == 4
    assert SpeculativeConfig("ngram").suffix_decoding_max_tree_depth is None
    with pytest.raises(ConfigError, match="must be <= 16"):
        SpeculativeConfig("ngram", num_speculative_tokens=20)
    with pytest.raises(ConfigError, match="must be <= 30"):
        SpeculativeConfig("suffix", num_speculative_tokens=31, suffix_decoding_max_tree_depth=30)


def test_draft_share_of_the_verify_budget():
    """Each request drafts at most its even share of SPEC_MAX_VERIFY_TOKENS (32) query rows, less its
    own token; a step speculates while every request's share holds min(k, 4) drafts."""
    suffix = SpeculativeConfig("suffix")  # k = 24
    assert [suffix.draft_share(n) for n in (1, 2, 3, 4, 5, 6, 7, 8, 64)] == [24, 15, 9, 7, 5, 4, 0, 0, 0]
    ngram = SpeculativeConfig("ngram")  # k = 4: the step rule as before, 4 drafts each while on
    assert [ngram.draft_share(n) for n in (1, 6, 7)] == [4, 4, 0]
    two = SpeculativeConfig("ngram", num_speculative_tokens=2)
    assert [two.draft_share(n) for n in (1, 10, 11)] == [2, 2, 0]
    given = SpeculativeConfig("suffix", disable_by_batch_size=3)  # vLLM's rule instead
    assert [given.draft_share(n) for n in (1, 3, 4)] == [24, 24, 0]


# ---- the engine ----------------------------------------------------------------------------------


def test_greedy_equals_no_speculation_and_drafts_across_requests(markov_llama):  # noqa: F811
    kw = dict(kv_cache_space=0.02, max_model_len=256, block_size=16)
    off = LLM(markov_llama, **kw)
    on = LLM(markov_llama, speculative_config={"method": "suffix", "num_speculative_tokens": 6}, **kw)
    prompts = _chain_prompts(off)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = [c.token_ids for c in _run(off, prompts, params)]
    before = _spec_stats(on)
    assert [c.token_ids for c in _run(on, prompts, params)] == want
    after = _spec_stats(on)
    assert after.num_accepted_tokens - before.num_accepted_tokens >= 20
    # plain text (nothing to match in its prompt) again: now the global cache holds its output
    plain = prompts[2]
    mid = _spec_stats(on)
    assert [c.token_ids for c in _run(on, [plain], params)] == want[2:]
    assert _spec_stats(on).num_accepted_tokens - mid.num_accepted_tokens >= 10
    backend = on.llm_engine.backend
    backend.kv.check_invariants()
    assert backend.kv.num_free_blocks == backend.kv.num_blocks


def test_long_matches_draft_past_four_and_stay_exact(markov_llama):  # noqa: F811
    """vLLM's defaults (num_speculative_tokens = the tree depth): a request copying a long span
    drafts more than 4 tokens a step, at batch 1 and beside others, and greedy output is the same;
    the warm-up recorded every verify step a lone request takes."""
    kw = dict(kv_cache_space=0.02, max_model_len=256, block_size=16)
    off = LLM(markov_llama, **kw)
    on = LLM(markov_llama, speculative_config={"method": "suffix"}, **kw)
    backend = on.llm_engine.backend
    assert backend.scheduler.proposer.max_draft == 12  # (depth 24, factor 1: a 12-token match drafts 12)
    backend.warm_up()  # (a server's start-up): a lone request's verify graphs, 2 to 13 rows
    graphs = backend.runner.graphs
    assert {(1, q) for q in range(2, 14)} <= set(graphs.verify_graphs)
    captured = len(graphs.verify_graphs)
    prompts = _chain_prompts(off)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = [c.token_ids for c in _run(off, prompts, params)]
    assert [c.token_ids for c in _run(on, prompts[:1], params)] == want[:1]
    assert len(graphs.verify_graphs) == captured and graphs.verify_replays >= 4
    st = _spec_stats(on)
    assert sum(st.num_accepted_tokens_per_pos[4:]) >= 5  # runs of 5+ accepted drafts
    assert st.num_accepted_tokens >= 25 and st.num_drafts <= 12
    assert [c.token_ids for c in _run(on, prompts, params)] == want
    backend.kv.check_invariants()
    assert backend.kv.num_free_blocks == backend.kv.num_blocks
