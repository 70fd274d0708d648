"""Tests of the batched sampler against transformers' independent logits processors."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import armserve.engine.sampler as sampler_module
from armserve.engine.sampler import (
    Sampler,
    apply_penalties,
    apply_top_k_top_p_min_p,
    build_sampling_batch,
    compute_logprobs_tensors,
    filtered_weights,
    sample_weights,
)
from armserve.sampling_params import SamplingParams

torch.set_num_threads(1)

NEG_INF = float("-inf")


def _batch(params, vocab, prompts=None, outputs=None, gens=None):
    n = len(params)
    return build_sampling_batch(
        params,
        prompts if prompts is not None else [[] for _ in range(n)],
        outputs if outputs is not None else [[] for _ in range(n)],
        gens if gens is not None else [None] * n,
        vocab,
    )


def _hf_filter(row_logits: torch.Tensor, temperature: float, k: int, p: float, min_p: float) -> torch.Tensor:
    """HF's warper chain (temperature, top-k, top-p, min-p) on one row -> [V] logits."""
    scores = row_logits.unsqueeze(0).clone()
    dummy = torch.zeros(1, 1, dtype=torch.long)
    scores = TemperatureLogitsWarper(temperature)(dummy, scores)
    if k > 0:
        scores = TopKLogitsWarper(k)(dummy, scores)
    if p < 1.0:
        scores = TopPLogitsWarper(p)(dummy, scores)
    if min_p > 0.0:
        scores = MinPLogitsWarper(min_p)(dummy, scores)
    return scores[0]


@pytest.mark.parametrize("window", [3, 512])  # top-p's first search window; 3 forces the fallback
@pytest.mark.parametrize("vocab", [7, 64, 1000])
@pytest.mark.parametrize("mode", ["k", "p", "min_p", "k+p", "all"])
def test_filter_mask_matches_transformers(vocab: int, mode: str, window: int, monkeypatch) -> None:
    monkeypatch.setattr(sampler_module, "_TOP_P_WINDOW", window)
    g = torch.Generator().manual_seed(vocab * 31 + len(mode))
    b = 12
    logits = torch.randn(b, vocab, generator=g) * 3
    temps = torch.rand(b, generator=g) * 1.5 + 0.3
    ks = [0, 1, 2, 5, vocab, vocab + 10, 3, 0, 50, 1, 4, 2000][:b]
    ps = [1.0, 0.9, 0.5, 0.01, 0.75, 0.99, 1.0, 0.3, 0.95, 0.6, 0.8, 0.2][:b]
    mps = [0.0, 0.05, 0.1, 0.0, 0.5, 0.01, 0.2, 0.9, 0.0, 0.3, 1.0, 0.02][:b]
    if "k" not in mode and mode != "all":
        ks = [0] * b
    if "p" not in mode.replace("min_p", "") and mode != "all":
        ps = [1.0] * b
    if mode not in ("min_p", "all"):
        mps = [0.0] * b
    params = [
        SamplingParams(temperature=float(t), top_k=k, top_p=p, min_p=mp)
        for t, k, p, mp in zip(temps, ks, ps, mps)
    ]
    batch = _batch(params, vocab)
    ours = apply_top_k_top_p_min_p(logits / batch.temperature.unsqueeze(1), batch.top_k, batch.top_p, batch.min_p)
    for i in range(b):
        ref = _hf_filter(logits[i], float(temps[i]), ks[i], ps[i], mps[i])
        assert torch.equal(torch.isinf(ours[i]), torch.isinf(ref)), (i, ks[i], ps[i], mps[i])
        kept = ~torch.isinf(ref)
        assert kept.any()
        torch.testing.assert_close(ours[i][kept], ref[kept])


def test_top_p_on_peaked_large_vocab_matches_transformers() -> None:
    # LM-like peaked rows (the nucleus fits the first search window) next to flat rows
    # (it does not, nor the wide one: those rows take the full-sort path) and a row between.
    g = torch.Generator().manual_seed(11)
    vocab = 5000
    logits = torch.randn(6, vocab, generator=g)
    logits[:3] *= 8
    logits[5] *= 2.5
    ps = [0.9, 0.95, 0.5, 0.9, 0.7, 0.9]
    ours = apply_top_k_top_p_min_p(logits, None, torch.tensor(ps), None)
    for i, p in enumerate(ps):
        ref = _hf_filter(logits[i], 1.0, 0, p, 0.0)
        assert torch.equal(torch.isinf(ours[i]), torch.isinf(ref)), i
    kept = (~torch.isinf(ours)).sum(-1)
    assert kept[:3].max() < sampler_module._TOP_P_WINDOW < kept[5] < sampler_module._TOP_P_WIDE < kept[3:5].min()


@pytest.mark.parametrize("window", [3, 512])  # top-p's first search window; 3 forces the fallback
@pytest.mark.parametrize("mode", ["temperature", "k", "p", "min_p", "k+p", "all", "mixed k+p"])
def test_sampled_distribution_is_the_reference_filters_softmax(mode: str, window: int, monkeypatch) -> None:
    """The sampler's own filter (`filtered_weights`, unnormalised probabilities) keeps the tokens
    `apply_top_k_top_p_min_p` keeps (itself checked against transformers above), with their
    softmax's probabilities, on flat and LM-like peaked rows of a vocabulary wider than one CDF
    block; greedy rows in the batch do not disturb the others."""
    monkeypatch.setattr(sampler_module, "_TOP_P_WINDOW", window)
    vocab = 5000
    g = torch.Generator().manual_seed(11)
    # (the last row spans ~300 logits: most of it lies below e^-86.5 of its best token)
    logits = torch.randn(7, vocab, generator=g) * torch.tensor([[1.0], [3.0], [8.0], [0.3], [5.0], [2.0], [40.0]])
    kw = {"temperature": dict(), "k": dict(top_k=50), "p": dict(top_p=0.85), "min_p": dict(min_p=0.02),
          "k+p": dict(top_k=300, top_p=0.9), "all": dict(top_k=700, top_p=0.95, min_p=0.001),
          "mixed k+p": dict(top_p=0.97)}[mode]
    params = [SamplingParams(temperature=t, **kw) for t in (0.7, 1.0, 1.3, 0.0, 0.9, 1.1, 0.7)]
    if mode == "mixed k+p":  # a different k in each row, top-p over what each keeps
        params = [SamplingParams(temperature=p.temperature, top_p=p.top_p, top_k=k)
                  for p, k in zip(params, (3, 40, 900, 7, 25, 200, 15))]
    batch = _batch(params, vocab)
    probs = Sampler.probs(logits.clone(), batch)
    temp = torch.where(batch.temperature == 0, 1.0, batch.temperature).unsqueeze(1)
    ref = torch.softmax(apply_top_k_top_p_min_p(logits / temp, batch.top_k, batch.top_p, batch.min_p), dim=-1)
    for r in range(len(params)):
        if params[r].temperature == 0:
            continue
        # the same tokens, but those below e^-86.5 of the best (near float32's denormals) weigh 0
        assert not bool((probs[r] > 0)[ref[r] == 0].any()), (mode, r)
        assert bool((probs[r] > 0)[ref[r] >= ref[r].max() * math.exp(-86.4)].all()), (mode, r)
        torch.testing.assert_close(probs[r], ref[r], rtol=1e-4, atol=1e-7)
    assert int((probs[6] == 0).sum()) > vocab // 2  # (the wide row really has such tokens)
    w = filtered_weights(logits.clone(), batch)
    assert torch.equal(w.amax(dim=-1), torch.ones(len(params)))  # the most likely token weighs 1


@pytest.mark.parametrize("vocab", [5, 1024, 2500, 3 * 1024 + 1])
def test_inverse_cdf_draw_matches_a_float64_reference(vocab: int) -> None:
    """`sample_weights` draws the token where the cumulative weight first exceeds u * total, as a
    float64 cumulative sum over the whole row finds it (up to draws within rounding of a
    boundary), never a zero-weight token, at u = 0, tiny, mid and next to 1, with zero runs at
    block ends and a vocabulary that is not a whole number of blocks."""
    g = torch.Generator().manual_seed(vocab)
    w = torch.rand(4, vocab, generator=g) ** 4
    w[w < 0.05] = 0.0  # scattered zeros
    w[1, : vocab // 2] = 0.0  # a row whose mass starts halfway
    w[2, vocab // 3:] = 0.0  # ... and one whose mass ends early
    w[3] = 0.0
    w[3, vocab - 1] = 0.25  # a single token: always drawn
    for r in range(3):
        if w[r].sum() == 0:
            w[r, vocab // 2] = 1.0
    us = torch.cat([torch.tensor([0.0, 1e-12, 0.5, 1 - 1e-12, 1 - 2 ** -53], dtype=torch.float64),
                    torch.rand(300, generator=g, dtype=torch.float64)])
    cum = w.double().cumsum(dim=-1)
    for u in us.tolist():
        got = sample_weights(w, torch.full((4,), u, dtype=torch.float64))
        assert bool((w.gather(1, got.unsqueeze(1)) > 0).all()), (u, got)
        target = u * cum[:, -1]
        want = torch.searchsorted(cum, target.unsqueeze(1), right=True).squeeze(1).clamp(max=vocab - 1)
        for r in range(4):
            if int(got[r]) != int(want[r]):
                # only a target within float rounding of the boundary between the two may differ
                lo, hi = sorted((int(got[r]), int(want[r])))
                edge = float(cum[r, lo])
                assert abs(float(target[r]) - edge) <= 1e-6 * float(cum[r, -1]), (u, r, int(got[r]), int(want[r]))
    assert bool((sample_weights(w[3:].expand(50, vocab), torch.rand(50, dtype=torch.float64)) == vocab - 1).all())


def test_filter_does_not_modify_input_and_keeps_one_token() -> None:
    logits = torch.tensor([[1.0, 5.0, 2.0, 5.0 - 1e-3], [0.0, 0.0, 0.0, 0.0]])
    before = logits.clone()
    out = apply_top_k_top_p_min_p(
        logits,
        torch.tensor([10, 4]),  # larger than the vocab / equal to it
        torch.tensor([1e-9, 1e-9]),
        torch.tensor([1.0, 0.0]),
    )
    assert torch.equal(logits, before)
    assert (~torch.isinf(out[0])).sum() == 1 and out[0, 1] == 5.0
    # A uniform row under a tiny top-p keeps its most likely token and the ones tied with it.
    assert (~torch.isinf(out[1])).all()


def test_top_k_ties_kept_like_transformers() -> None:
    logits = torch.tensor([[3.0, 1.0, 3.0, 3.0, 0.5]])
    ours = apply_top_k_top_p_min_p(logits, torch.tensor([2]), None, None)
    ref = TopKLogitsWarper(2)(torch.zeros(1, 1, dtype=torch.long), logits.clone())
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))


def test_greedy_is_argmax_and_logits_untouched() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g)
    before = logits.clone()
    params = [SamplingParams(temperature=0.0, top_k=3, top_p=0.5) for _ in range(6)]
    batch = _batch(params, 50)
    assert batch.all_greedy and not batch.all_random
    assert batch.top_k is None and batch.top_p is None  # filters are moot for greedy rows
    out = Sampler()(logits, batch)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.logprobs is None
    assert torch.equal(logits, before)


def test_mixed_batch_greedy_rows_are_argmax() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(8, 40, generator=g)
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0) for i in range(8)]
    batch = _batch(params, 40)
    assert not batch.all_greedy and not batch.all_random
    out = Sampler()(logits, batch)
    assert torch.equal(out.sampled_token_ids[1::2], logits[1::2].argmax(-1))


def test_seeded_rows_independent_of_batch_composition() -> None:
    vocab = 300
    g = torch.Generator().manual_seed(2)
    target_logits = torch.randn(1, vocab, generator=g)
    target_params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)

    def run(position: int, others: int, steps: int = 8) -> list[int]:
        gen = torch.Generator().manual_seed(1234)
        other_gens = [torch.Generator().manual_seed(99 + j) if j % 2 else None for j in range(others)]
        tokens = []
        for step in range(steps):
            rows_logits = [torch.randn(1, vocab) for _ in range(others)]
            rows_params = [SamplingParams(temperature=0.5 + 0.1 * j, top_k=j + 1) for j in range(others)]
            gens: list[torch.Generator | None] = list(other_gens)
            rows_logits.insert(position, target_logits)
            rows_params.insert(position, target_params)
            gens.insert(position, gen)
            batch = _batch(rows_params, vocab, gens=gens)
            out = Sampler()(torch.cat(rows_logits), batch)
            tokens.append(int(out.sampled_token_ids[position]))
        return tokens

    alone = run(0, 0)
    assert alone == run(2, 4)
    assert alone == run(0, 3)
    assert alone == run(5, 5)
    assert len(set(alone)) > 1  # it really samples


def test_samples_stay_inside_filtered_set() -> None:
    vocab = 80
    g = torch.Generator().manual_seed(3)
    base = torch.randn(4, vocab, generator=g) * 2
    settings = [dict(top_k=3), dict(top_p=0.6), dict(min_p=0.3), dict(top_k=10, top_p=0.8, min_p=0.05)]
    reps = 500
    logits = base.repeat_interleave(reps, dim=0)
    params = [SamplingParams(temperature=1.3, **s) for s in settings for _ in range(reps)]
    batch = _batch(params, vocab)
    torch.manual_seed(0)
    out = Sampler()(logits, batch).sampled_token_ids.view(4, reps)
    for i, s in enumerate(settings):
        ref = _hf_filter(base[i], 1.3, s.get("top_k", 0), s.get("top_p", 1.0), s.get("min_p", 0.0))
        allowed = set(torch.nonzero(~torch.isinf(ref)).flatten().tolist())
        drawn = set(out[i].tolist())
        assert drawn <= allowed, (s, drawn - allowed)
        assert len(drawn) > 1 or len(allowed) == 1


def test_empirical_distribution_matches_softmax() -> None:
    vocab, draws, temperature = 8, 40000, 0.8
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, -3.0]])
    params = [SamplingParams(temperature=temperature)] * draws
    batch = _batch(params, vocab)
    torch.manual_seed(1)
    tokens = Sampler()(logits.expand(draws, vocab), batch).sampled_token_ids
    freq = torch.bincount(tokens, minlength=vocab).double() / draws
    expected = torch.softmax(logits[0].double() / temperature, -1)
    # 5 standard errors of a binomial proportion: fails by chance with p << 1e-4.
    tol = 5 * torch.sqrt(expected * (1 - expected) / draws) + 1e-4
    assert torch.all((freq - expected).abs() <= tol), (freq, expected)
    # The same with top-k 3: the renormalised distribution over the 3 best tokens.
    batch = _batch([SamplingParams(temperature=temperature, top_k=3)] * draws, vocab)
    tokens = Sampler()(logits.expand(draws, vocab), batch).sampled_token_ids
    freq = torch.bincount(tokens, minlength=vocab).double() / draws
    top = logits[0].topk(3).indices
    expected = torch.zeros(vocab, dtype=torch.double)
    expected[top] = torch.softmax(logits[0, top].double() / temperature, -1)
    tol = 5 * torch.sqrt(expected * (1 - expected) / draws) + 1e-4
    assert torch.all((freq - expected).abs() <= tol), (freq, expected)


def _penalised_logits(logits: torch.Tensor, batch) -> torch.Tensor:
    """The logits after the batch's penalties (a copy)."""
    return apply_penalties(
        logits.clone(),
        batch.prompt_token_ids,
        batch.output_token_ids,
        batch.presence_penalty,
        batch.frequency_penalty,
        batch.repetition_penalty,
    )


def test_penalties_on_padded_rows_with_repeats_equal_a_per_token_loop() -> None:
    """The gather-and-scatter penalties against the formulas applied token by token: rows with
    repeated ids, padding, a row holding no token, and rows whose first held id repeats."""
    g = torch.Generator().manual_seed(5)
    for _ in range(50):
        rows, vocab = 5, 40
        logits = torch.randn(rows, vocab, generator=g) * 3
        prompt = torch.randint(0, vocab, (rows, 6), generator=g)
        output = torch.randint(0, vocab // 4, (rows, 9), generator=g)  # (narrow: many repeats)
        prompt[torch.rand(rows, 6, generator=g) < 0.4] = vocab
        output[torch.rand(rows, 9, generator=g) < 0.4] = vocab
        prompt[2], output[2] = vocab, vocab  # holds nothing
        pres, freq = torch.randn(rows, generator=g), torch.randn(rows, generator=g)
        rep = torch.rand(rows, generator=g) + 0.5
        want = logits.clone()
        for r in range(rows):
            outs = [t for t in output[r].tolist() if t < vocab]
            for t in set(outs) | {t for t in prompt[r].tolist() if t < vocab}:
                x = want[r, t]
                want[r, t] = x / rep[r] if x > 0 else x * rep[r]
            for t in set(outs):
                want[r, t] = want[r, t] - freq[r] * outs.count(t)
                want[r, t] = want[r, t] - pres[r]
        got = apply_penalties(logits.clone(), prompt, output, pres, freq, rep)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        assert torch.equal(got[2], logits[2])


def test_presence_frequency_penalties_direct_formula() -> None:
    vocab = 20
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, vocab, generator=g)
    prompts = [[1, 2, 3], [4, 4], [5]]
    outputs = [[3, 3, 7], [], [9, 9, 9, 5]]
    params = [
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(presence_penalty=-1.0, frequency_penalty=1.0),
        SamplingParams(presence_penalty=1.5, frequency_penalty=-0.5),
    ]
    batch = _batch(params, vocab, prompts, outputs)
    got = _penalised_logits(logits, batch)
    expected = logits.clone()
    for i, (p, out) in enumerate(zip(params, outputs)):
        for t in set(out):  # prompt tokens are not penalised by presence/frequency
            expected[i, t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
    torch.testing.assert_close(got, expected)


def test_repetition_penalty_matches_transformers() -> None:
    vocab = 30
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, vocab, generator=g) * 2
    prompts = [[1, 2, 3, 4], [10, 11], [0]]
    outputs = [[3, 5, 5], [12], []]
    penalties = [1.3, 0.7, 2.0]
    batch = _batch([SamplingParams(repetition_penalty=r) for r in penalties], vocab, prompts, outputs)
    got = _penalised_logits(logits, batch)
    for i, r in enumerate(penalties):
        ids = torch.tensor([prompts[i] + outputs[i]])
        ref = RepetitionPenaltyLogitsProcessor(r)(ids, logits[i : i + 1].clone())
        torch.testing.assert_close(got[i], ref[0])


def test_penalties_change_greedy_choice_and_mixed_rows() -> None:
    vocab = 5
    logits = torch.tensor([[0.0, 3.0, 2.9, 0.0, 0.0], [0.0, 3.0, 2.9, 0.0, 0.0]])
    params = [SamplingParams(temperature=0.0, frequency_penalty=0.5), SamplingParams(temperature=0.0)]
    batch = _batch(params, vocab, [[0], [0]], [[1], [1]])
    out = Sampler()(logits, batch)
    assert out.sampled_token_ids.tolist() == [2, 1]


def test_min_tokens_forbids_stop_tokens() -> None:
    vocab, eos = 10, 9
    logits = torch.zeros(3, vocab)
    logits[:, eos] = 10.0
    logits[:, 4] = 9.0
    logits[:, 5] = 8.0
    p = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[4])
    p.update_from_generation_config({eos})
    assert p.all_stop_token_ids == {4, eos}
    outputs = [[1], [1, 2], [1, 2, 3]]  # rows 0 and 1 are below min_tokens
    batch = _batch([p, p, p], vocab, outputs=outputs)
    assert [r for r, _ in batch.min_tokens_mask] == [0, 1]
    assert batch.min_tokens_mask[0][1] == [4, eos]
    out = Sampler()(logits, batch)
    assert out.sampled_token_ids.tolist() == [5, 5, eos]
    # Random rows too: EOS never drawn while below min_tokens.
    q = SamplingParams(temperature=1.0, min_tokens=2)
    q.update_from_generation_config({eos})
    batch = _batch([q] * 200, vocab, outputs=[[1]] * 200)
    out = Sampler()(logits.new_zeros(200, vocab), batch)
    assert eos not in out.sampled_token_ids.tolist()


def _reference_logprobs(logits: torch.Tensor, targets: torch.Tensor, k: int):
    lp = torch.log_softmax(logits.double(), -1)
    order = lp.argsort(dim=-1, descending=True)
    ranks = []
    for i, t in enumerate(targets.tolist()):
        ranks.append(int((lp[i] > lp[i, t]).sum()) + 1)
    return lp, order[:, :k], torch.tensor(ranks)


def test_compute_logprobs_tensors() -> None:
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(5, 40, generator=g)
    targets = torch.tensor([0, 39, 7, 7, 20])
    for k in (0, 1, 5, 60):
        out = compute_logprobs_tensors(logits, targets, k)
        lp, top, ranks = _reference_logprobs(logits, targets, k)
        kk = min(k, 40)
        assert out.token_ids.shape == (5, kk + 1) and out.logprobs.shape == (5, kk + 1)
        assert out.token_ids.dtype == torch.int64 and out.logprobs.dtype == torch.float32
        assert torch.equal(out.token_ids[:, 0], targets)
        assert torch.equal(out.token_ids[:, 1:], top)
        torch.testing.assert_close(out.logprobs.double(), lp.gather(1, out.token_ids), rtol=0, atol=1e-5)
        assert torch.equal(out.ranks, ranks)
        assert out.ranks.dtype == torch.int64


def test_sampler_logprobs_are_raw_model_logprobs() -> None:
    vocab = 25
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(4, vocab, generator=g)
    params = [
        SamplingParams(temperature=0.0, logprobs=2, repetition_penalty=1.5),
        SamplingParams(temperature=0.7, top_k=3, logprobs=0),
        SamplingParams(temperature=1.0, seed=3),
        SamplingParams(temperature=2.0, top_p=0.5, logprobs=4, presence_penalty=1.0),
    ]
    gens = [None, None, torch.Generator().manual_seed(3), None]
    batch = _batch(params, vocab, [[1, 2]] * 4, [[3]] * 4, gens)
    assert batch.max_num_logprobs == 4
    assert set(batch.generators) == {2}
    out = Sampler()(logits, batch)
    assert out.logprobs is not None
    lp, top, ranks = _reference_logprobs(logits, out.sampled_token_ids, 4)
    assert torch.equal(out.logprobs.token_ids[:, 0], out.sampled_token_ids)
    assert torch.equal(out.logprobs.token_ids[:, 1:], top)
    torch.testing.assert_close(out.logprobs.logprobs.double(), lp.gather(1, out.logprobs.token_ids), rtol=0, atol=1e-5)
    assert torch.equal(out.logprobs.ranks, ranks)


def test_build_batch_fields() -> None:
    vocab = 16
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=100), SamplingParams(top_k=-1)]
    batch = _batch(params, vocab, [[1, 2, 3], [4], []], [[5], [], [6, 7]])
    assert batch.top_k is None and batch.top_p is None and batch.min_p is None  # 100 >= vocab
    assert batch.repetition_penalty is None and batch.prompt_token_ids is None and batch.output_token_ids is None
    assert batch.max_num_logprobs is None and batch.min_tokens_mask == [] and batch.generators == {}
    assert batch.temperature.tolist() == [0.0, 1.0, 1.0]
    params = [SamplingParams(frequency_penalty=0.1), SamplingParams(top_k=4, top_p=0.5, min_p=0.1)]
    batch = _batch(params, vocab, [[1, 2, 3], [4]], [[5], []])
    assert batch.top_k.tolist() == [vocab, 4]
    assert batch.top_p.tolist() == [1.0, 0.5]
    assert batch.prompt_token_ids.shape[0] == 2 and batch.output_token_ids.tolist() == [[5], [vocab]]
    assert batch.all_random and not batch.all_greedy
    assert math.isclose(float(batch.min_p[1]), 0.1, rel_tol=1e-6)
