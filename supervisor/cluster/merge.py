"""The leader's merge of the nodes' step summaries into the job's steps (``NodeMerger``).

Each node summarises its own ranks' reports of a step (``node.sketch.StepSummary``); merging the
nodes' summaries gives exactly the summary of every rank in one place. Pure logic.
"""

from __future__ import annotations

from collections.abc import Iterable

from babysit.supervisor.node.sketch import StepSummary


class NodeMerger:
    """The leader's merge of the nodes' summaries of each step into the job's, in step order.

    **Emission rule** (``completion.Completion``'s, with nodes in place of ranks). Each node
    sends its summaries in step order on its own connection, so once every expected node has
    sent step *s* or a later one, nothing more of *s*, nor of any step before it, is coming:

    - an open step is emitted as soon as every node in ``expected`` has sent it or a later
      step. That covers the complete step (every node sent it) and the step some node never
      sends (it dropped reports, or none of its ranks reported that step): it goes out with
      what arrived, once that node has moved past it;
    - when more than ``max_pending`` steps are open (a node stopped sending but is still
      expected), the oldest is emitted, one per ``add``;
    - ``flush()`` emits everything open (the attempt ended).

    Steps come out in increasing step order, each at most once. A summary of a step at or
    below the newest emitted is dropped and counted in ``late``; one sharing a rank with what
    its step already holds (a node sent it twice) is dropped and counted in ``duplicates``.
    A node outside ``expected`` is merged like the others but holds nothing back. With no
    expected node at all, every step is emitted as it arrives.

    Calling rules: ``add`` each node's summaries in the order the node sent them; ``add``
    takes ownership of the summary (it may be merged into and emitted). ``reset(nodes)``
    between attempts (a rollback reuses step numbers). Setting ``expected`` mid-attempt (a node
    left) takes effect at the next ``add``, or at once with ``release()``.
    Memory: at most ``max_pending`` open steps, one ``StepSummary`` each.
    """

    def __init__(self, nodes: Iterable[int], max_pending: int = 64) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be at least 1, got {max_pending}")
        self.max_pending = max_pending
        self.late = 0
        """Summaries dropped because their step was already emitted (since construction)."""
        self.duplicates = 0
        """Summaries dropped because a rank of theirs was already merged into their step."""
        self._expected = frozenset(nodes)
        self._newest: dict[int, int] = {}  # node -> the newest step it sent this attempt
        self._open: dict[int, StepSummary] = {}
        self._emitted: int | None = None  # the newest step emitted this attempt

    @property
    def expected(self) -> frozenset[int]:
        """The nodes taking part in this attempt: a step waits for each of them."""
        return self._expected

    @expected.setter
    def expected(self, nodes: Iterable[int]) -> None:
        self._expected = frozenset(nodes)

    @property
    def n_open(self) -> int:
        """Steps received but not yet emitted."""
        return len(self._open)

    def add(self, node: int, summary: StepSummary) -> list[StepSummary]:
        """One node's summary of one step; returns the merged steps emitted now, in order."""
        step = summary.step
        if step > self._newest.get(node, step - 1):
            self._newest[node] = step
        if self._emitted is not None and step <= self._emitted:
            self.late += 1
            return []
        held = self._open.get(step)
        if held is None:
            self._open[step] = summary
        elif held.shared_rank(summary) is not None:
            self.duplicates += 1
        else:
            held.merge(summary)
        return self.release()

    def release(self) -> list[StepSummary]:
        """The open steps the rule lets go now: after ``expected`` shrank, for instance."""
        out: list[StepSummary] = []
        if self._expected and all(n in self._newest for n in self._expected):
            frontier = min(self._newest[n] for n in self._expected)
            out = [self._emit(s) for s in sorted(self._open) if s <= frontier]
        elif not self._expected:
            out = self.flush()
        while len(self._open) > self.max_pending:
            out.append(self._emit(min(self._open)))
        return out

    def flush(self) -> list[StepSummary]:
        """Emit every open step, in order (the attempt ended)."""
        return [self._emit(s) for s in sorted(self._open)]

    def reset(self, nodes: Iterable[int]) -> None:
        """A new attempt with ``nodes`` taking part: forget open steps and what was emitted.
        ``late`` and ``duplicates`` keep counting."""
        self._expected = frozenset(nodes)
        self._newest.clear()
        self._open.clear()
        self._emitted = None

    def _emit(self, step: int) -> StepSummary:
        self._emitted = step
        return self._open.pop(step)
