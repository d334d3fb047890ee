"""How messages name ranks, as a person writes them (pure).

Findings, remedies and journal summaries are read as sentences: "ranks 2 and 3 resume with
fresh random streams", never "ranks [2, 3]" or "rank(s) 2, 3".
"""

from __future__ import annotations

from collections.abc import Iterable

SHOWN = 8
"""Most ranks (or runs of ranks) named before the rest is counted: "and 56 more"."""


def said_ranks(ranks: Iterable[int]) -> str:
    """``ranks`` as words: "rank 3", "ranks 2 and 3", "ranks 0-15 and 17", "ranks 0, 4, ...,
    28 and 9 more"; "no rank" for none. Runs of three or more are ranges; order and repeats
    do not matter."""
    ordered = sorted(set(ranks))
    if not ordered:
        return "no rank"
    if len(ordered) == 1:
        return f"rank {ordered[0]}"
    runs: list[str] = []
    start = prev = ordered[0]
    for rank in [*ordered[1:], None]:
        if rank is not None and rank == prev + 1:
            prev = rank
            continue
        runs += [f"{start}-{prev}"] if prev - start >= 2 else list(map(str, range(start, prev + 1)))
        if rank is not None:
            start = prev = rank
    if len(runs) > SHOWN:
        runs = [*runs[:SHOWN], f"{len(runs) - SHOWN} more"]
    if len(runs) == 1:
        return f"ranks {runs[0]}"
    return "ranks " + ", ".join(runs[:-1]) + " and " + runs[-1]


def ranks_doing(ranks: Iterable[int], one: str, many: str) -> str:
    """``ranks`` as words with their verb agreeing: ``ranks_doing([1], "is", "are")`` is
    "rank 1 is", ``ranks_doing([1, 2], "disagrees", "disagree")`` "ranks 1 and 2 disagree"."""
    named = set(ranks)
    return f"{said_ranks(named)} {one if len(named) == 1 else many}"
