"""Ranks named as a person writes them (``policies/wording.py``)."""

from __future__ import annotations

import pytest

from babysit.policies.wording import ranks_doing, said_ranks
from tests.journal_text import unreadable


@pytest.mark.parametrize(("ranks", "words"), [
    ([3], "rank 3"),
    ([3, 2, 2], "ranks 2 and 3"),
    ([1, 2, 5], "ranks 1, 2 and 5"),
    ([0, 1, 2, 3, 8], "ranks 0-3 and 8"),
    (range(64), "ranks 0-63"),
    (range(0, 64, 4), "ranks 0, 4, 8, 12, 16, 20, 24, 28 and 8 more"),
    ([], "no rank"),
])
def test_ranks_read_as_words(ranks: list[int], words: str) -> None:
    assert said_ranks(ranks) == words
    assert unreadable(f"{words} resume with fresh random streams") == []


def test_the_verb_agrees_with_the_ranks() -> None:
    assert ranks_doing([1], "is", "are") == "rank 1 is"
    assert ranks_doing([1, 1], "disagrees", "disagree") == "rank 1 disagrees"
    assert ranks_doing([2, 1], "disagrees", "disagree") == "ranks 1 and 2 disagree"


def test_what_does_not_read_as_a_sentence_is_named() -> None:
    assert unreadable("ranks [2, 3] resume") == ["a Python list in 'ranks [2, 3] resume'"]
    assert unreadable("rank None is stuck") == ["a None in 'rank None is stuck'"]
    assert unreadable("relaunch: relaunch relaunch") == [
        "a doubled word in 'relaunch: relaunch relaunch'"]
    assert unreadable("4611686018427387865 steps lost") == [
        "a sentinel number in '4611686018427387865 steps lost'"]
    assert unreadable("hang at step 9: rank 3 is stuck [node 1, host gpu-17]") == []
