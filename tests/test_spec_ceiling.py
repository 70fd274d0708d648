"""benchmarks/spec_ceiling.py's arithmetic, against hand-worked cases: the oracle lookup drafter's
verification steps and the step costs by row count it weighs them with (docs/benchmarks.md quotes
its ceilings)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

from spec_ceiling import MAX_DRAFT, oracle_steps, row_costs  # noqa: E402


def test_oracle_steps_copy_what_the_context_has():
    # nothing to copy: a step per token
    assert oracle_steps([1, 2, 3], [9, 8, 7]) == [1, 1, 1]
    # [1, 2] appears at the start of the context: from the third token on, the rest is copied in one step
    # (the answer's end cuts the step short)
    assert oracle_steps([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6]) == [1, 1, 4]
    # the longest n-gram found is the one followed (as prompt lookup does): [5, 6, 7] drafts 1 (then 9,
    # rejected) although [6, 7] alone would have drafted 1, 2, 3; then [6, 7, 1, 2] drafts the 3
    assert oracle_steps([6, 7, 1, 2, 3, 5, 6, 7, 1, 9, 5, 6, 7], [1, 2, 3]) == [2, 1]
    # the answer repeating itself; drafts stop at MAX_DRAFT tokens
    loop = [4, 5] * 20
    steps = oracle_steps([4, 5], loop)
    assert sum(steps) == len(loop) and max(steps) == MAX_DRAFT + 1


def test_row_costs_interpolate_and_extend():
    costs = row_costs({1: [1.0, 3.0, 2.0], 2: [2.4], 4: [4.0], 40: [99.0]}, 6)
    assert costs == pytest.approx({1: 1.0, 2: 1.2, 3: 1.6, 4: 2.0, 5: 2.4, 6: 2.8})
