"""Edge cases of the acceptance rules that the known-answer tests (tests/test_mdlm.py, tests/test_usdm.py)
leave open: ties, the bound reached exactly, scores of -inf, and seeded randomness. Found by `make mutate`
(docs/testing.md)."""

from __future__ import annotations

import torch

from dlm.sampling.common import entropy_bound_accept
from dlm.sampling.mdlm import select_random, top_k_of


def test_entropy_bound_is_inclusive():
    """cumulative entropy before a position == bound still accepts it (the rule is <=, in exact binary
    fractions here)."""
    ent = torch.tensor([1.0, 0.25, 0.0, 0.25])  # sorted 0, .25, .25, 1: sums before 0, 0, .25, .5
    assert entropy_bound_accept(ent, 0.5).tolist() == [True, True, True, True]
    assert entropy_bound_accept(ent, 0.4999).tolist() == [False, True, True, True]


def test_entropy_ties_go_left_to_right():
    """Among equal entropies the leftmost positions win (a stable order: the same canvas on every machine)."""
    ent = torch.ones(20, dtype=torch.float64)
    ent[::3] = 2.0
    free = torch.ones(20, dtype=torch.bool)
    got = entropy_bound_accept(ent, 0.5, free, k_min=4)
    assert got.nonzero().squeeze(1).tolist() == [1, 2, 4, 5]
    got = entropy_bound_accept(ent, 10.5, free)  # eleven passing terms of 1.0: the first eleven ties
    assert got.nonzero().squeeze(1).tolist() == [1, 2, 4, 5, 7, 8, 10, 11, 13, 14, 16]


def test_top_k_of_ranks_minus_infinity_after_finite_scores_but_before_unmasked():
    score = torch.tensor([float("-inf"), 0.5, 0.2, 0.9])
    masked = torch.tensor([True, True, True, False])
    assert top_k_of(score, masked, 2).tolist() == [False, True, True, False]
    assert top_k_of(score, masked, 3).tolist() == [True, True, True, False]  # never the unmasked one
    assert top_k_of(score, masked, 0).tolist() == [False] * 4


def test_select_random_is_a_function_of_its_generator():
    masked = torch.ones(32, dtype=torch.bool)

    def pick(seed, global_seed):
        torch.manual_seed(global_seed)  # the global generator is elsewhere on each call
        return select_random(masked, 5, torch.Generator().manual_seed(seed)).tolist()

    assert pick(0, 1) == pick(0, 2) and pick(0, 1) != pick(1, 1) and sum(pick(2, 1)) == 5
