"""`NgramProposer`: the longest recurring suffix n-gram in bounds, its most recent earlier
occurrence, the tokens after it (capped), nothing when no n-gram recurs."""

from __future__ import annotations

import pytest

from pagoda.spec_decode import NgramProposer


def test_longest_ngram_wins_over_a_more_recent_shorter_one() -> None:
    # Suffix [7, 8, 9]: the 3-gram recurs at 0 (followed by 1, 2); the 1-gram [9] also recurs
    # more recently at 5 (followed by 4), but longer matches are tried first.
    p = NgramProposer(2, 1, 3)
    assert p.propose([7, 8, 9, 1, 2, 9, 4, 7, 8, 9]) == [1, 2]


def test_most_recent_occurrence_of_the_ngram() -> None:
    p = NgramProposer(3, 2, 2)
    assert p.propose([1, 2, 9, 1, 2, 7, 1, 2]) == [7, 1, 2]


def test_drafts_are_capped_and_may_run_into_the_suffix() -> None:
    p = NgramProposer(5, 1, 3)
    assert p.propose([1, 2, 3, 4, 1, 2, 3]) == [4, 1, 2, 3]  # what follows, up to the end
    assert p.propose([1, 2, 3, 4, 1, 2, 3], max_drafts=2) == [4, 1]
    assert p.propose([1, 2, 3, 4, 1, 2, 3], max_drafts=0) == []


def test_no_recurring_ngram_in_bounds_proposes_nothing() -> None:
    assert NgramProposer(3, 1, 3).propose([5, 6, 7, 8]) == []
    assert NgramProposer(3, 2, 3).propose([1, 2, 3, 1, 4]) == []  # only [1] recurs, min is 2
    assert NgramProposer(3, 1, 3).propose([]) == []
    assert NgramProposer(3, 1, 3).propose([4]) == []


def test_matches_a_brute_force_search() -> None:
    import random

    rng = random.Random(0)
    p = NgramProposer(3, 1, 4)
    for _ in range(300):
        toks = [rng.randrange(4) for _ in range(rng.randint(0, 30))]
        want: list[int] = []
        for n in range(min(4, len(toks) - 1), 0, -1):
            hits = [i for i in range(len(toks) - n) if toks[i : i + n] == toks[len(toks) - n :]]
            if hits:
                want = toks[hits[-1] + n : hits[-1] + n + 3]
                break
        assert p.propose(toks) == want, toks


@pytest.mark.parametrize("args", [(0, 1, 2), (3, 0, 2), (3, 3, 2)])
def test_bad_settings_are_rejected(args) -> None:
    with pytest.raises(ValueError):
        NgramProposer(*args)
