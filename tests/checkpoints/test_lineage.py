"""The run's one history of states (``checkpoints/lineage.py``): timelines, fencing, and the
store's invariants under random sequences of what a long run meets.

The store is the real one: a ``Catalog`` over real folders (states committed by the real commit
paths: ``save.commit`` for checkpoints on disk, ``memory.commit`` for memory copies whose files
are in a node's folder), the lineage record on disk, and the retention the supervisor runs. A
hypothesis state machine drives saves, late commits, verdicts, rollbacks, relaunches,
retention, takeovers (a new ``Catalog`` reading the folder afresh) and supervisor crashes, and
checks after every step:

- nothing from an abandoned timeline is ever chosen;
- the current timeline's newest state is never deleted;
- a chosen state's step never exceeds the current timeline's high-water mark.
"""

from __future__ import annotations

import os
from pathlib import Path

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from babysit.checkpoints import Catalog, Verdict, lineage, memory, step_dir
from babysit.checkpoints.layout import rank_state_name
from babysit.checkpoints.manifest import hash_file
from babysit.checkpoints.memory import Part, Place, copy_dir, parse_copy_dir
from babysit.checkpoints.memory_copy import _prune
from babysit.checkpoints.save import commit, hash_part


def save_on_disk(root: Path, step: int, timeline: str | None) -> str:
    """A committed checkpoint on disk of ``step`` in ``timeline``, as a real save leaves it;
    its id."""
    path = step_dir(root, step)
    path.mkdir(parents=True, exist_ok=True)
    (path / "__0_0.distcp").write_bytes(os.urandom(64))
    (path / rank_state_name(0)).write_bytes(os.urandom(16))
    manifest = commit(path, [hash_part(path, 0)], {
        "step": step, "cursor": step, "lr_scale": 1.0, "world_size": 1, "timeline": timeline})
    return manifest.id


def copy_in_memory(root: Path, shm: Path, step: int, timeline: str | None) -> str:
    """A committed memory copy of ``step`` in ``timeline``: its files in the node's folder,
    its manifest in the root; its id."""
    data = copy_dir(shm, step, timeline)
    data.mkdir(parents=True, exist_ok=True)
    (data / "__0_0.distcp").write_bytes(os.urandom(64))
    part = Part(0, 0, (hash_file(data, "__0_0.distcp"),), cursor=step, timeline=timeline)
    return memory.commit(root, step, {0: part}, 1, shm).id


# -- the lineage alone -----------------------------------------------------------------------------

def test_a_rollback_fences_the_abandoned_states_and_the_chain_keeps_the_ones_before() -> None:
    first = lineage.Lineage().begin(None, 0, attempt=0)
    a = first.current
    assert a is not None
    # Attempt 0 trained to 295; the spike rolls back to its state of 200: timeline b.
    second = first.begin(a, 200, attempt=1)
    b = second.current
    assert second.chain() == ((b, None), (a, 200))
    assert second.live(a, 200) and second.live(a, 150)
    assert not second.live(a, 290) and not second.live(a, 295)  # abandoned: fenced
    assert second.live(b, 245)
    # Then a crash at 248 resumes from b's copy of 245: c; b up to 245 and a up to 200 live.
    third = second.begin(b, 245, attempt=2)
    assert third.chain() == ((third.current, None), (b, 245), (a, 200))
    assert not third.live(b, 247) and third.live(b, 245) and not third.live(a, 201)
    # A state of a timeline the run does not know is another run's; one of none is live.
    assert not third.known("elsewhere") and not third.live("elsewhere", 1)
    assert third.live(None, 10_000)


def test_the_record_survives_a_new_reader_and_a_damaged_one_reads_as_none(tmp_path: Path) -> None:
    history = lineage.begin(tmp_path, None, 0, attempt=0)
    history = lineage.begin(tmp_path, history.current, 120, attempt=1)
    assert lineage.read(tmp_path) == history
    assert lineage.current(tmp_path) == history.current
    (tmp_path / "lineage.json").write_text("{torn")
    assert lineage.read(tmp_path) == lineage.Lineage()  # every state live, as before lineage


def test_the_catalog_never_chooses_an_abandoned_state_and_retention_takes_it_first(
        tmp_path: Path) -> None:
    """The measured failure: after a rollback the new timeline's memory copies were deleted as
    they were made, because retention kept the abandoned timeline's higher steps, and a
    takeover's first candidate was the abandoned pending copy of step 295."""
    root, shm = tmp_path / "ckpt", tmp_path / "shm"
    catalog = Catalog(root, memory=Place(0, shm, lambda: [0]))
    a = lineage.begin(root, None, 0, attempt=0).current
    save_on_disk(root, 200, a)
    for step in range(205, 300, 5):
        copy_in_memory(root, shm, step, a)
        catalog.retain(keep_last=3)
    catalog.promote(healthy_step=260, probation_steps=50)  # 200 good
    # The spike at 295 rolls back to 200: timeline b.
    b = lineage.begin(root, a, 200, attempt=1).current
    for step in range(205, 250, 5):
        copy_in_memory(root, shm, step, b)
        catalog.retain(keep_last=3)
    copies = [c for c in catalog.checkpoints() if c.manifest.is_memory]
    assert [(c.step, c.timeline) for c in copies] == [(240, b), (245, b)]
    # A relaunch (or a takeover: a new reader) takes b's newest copy, never a's 295.
    for reader in (catalog, Catalog(root, memory=Place(0, shm, lambda: [0]))):
        chosen = reader.choose_for_rollback(None, allow_pending=True).checkpoint
        assert chosen is not None and (chosen.step, chosen.timeline) == (245, b)
    # The rank side sweeps a's copies from the node's folder: off b's chain.
    _prune(shm / memory.MEMORY_DIR, memory.KEEP, chain=lineage.read(root).chain())
    left = sorted(parse_copy_dir(p.name) for p in (shm / memory.MEMORY_DIR).iterdir())
    assert all(t == b for _, t in left)  # type: ignore[misc]
    assert (245, b) in left


def test_a_copy_of_a_step_the_old_timeline_also_wrote_goes_into_a_folder_of_its_own(
        tmp_path: Path) -> None:
    assert copy_dir(tmp_path, 250, "aaaa") != copy_dir(tmp_path, 250, "bbbb")
    assert parse_copy_dir(copy_dir(tmp_path, 250, "bbbb").name) == (250, "bbbb")
    assert parse_copy_dir(copy_dir(tmp_path, 250).name) == (250, None)
    assert parse_copy_dir("rank_0.pt") is None


# -- the store under random histories -------------------------------------------------------------

KINDS = st.sampled_from(["disk", "memory"])


class Store(RuleBasedStateMachine):
    """A run's store under a random history. The model keeps its own timelines (parent, fork)
    and every state it made, to judge the store by, never the store's own answers."""

    def __init__(self) -> None:
        super().__init__()
        import tempfile

        self.tmp = Path(tempfile.mkdtemp(prefix="babysit-lineage-"))
        self.root, self.shm = self.tmp / "ckpt", self.tmp / "shm"
        self.catalog = self._reader()
        self.attempt = 0
        self.timelines: dict[str, tuple[str | None, int]] = {}
        self.current = self._begin(None, 0)
        self.step = 0  # the step the current timeline has trained to
        self.states: dict[str, tuple[str, int, str]] = {}  # id -> (timeline, step, kind)
        self.in_flight: list[tuple[str, int, str]] = []  # saves begun, not yet committed

    def teardown(self) -> None:
        import shutil

        shutil.rmtree(self.tmp, ignore_errors=True)

    # -- the model ----------------------------------------------------------------------------

    def _reader(self) -> Catalog:
        return Catalog(self.root, memory=Place(0, self.shm, lambda: [0]))

    def _begin(self, parent: str | None, fork: int) -> str:
        history = lineage.begin(self.root, parent, fork, self.attempt)
        assert history.current is not None
        self.timelines[history.current] = (parent, fork)
        self.attempt += 1
        return history.current

    def _live(self, timeline: str, step: int) -> bool:
        at: str | None = self.current
        limit: int | None = None
        while at is not None:
            if at == timeline:
                return limit is None or step <= limit
            parent, fork = self.timelines[at]
            limit = fork if limit is None else min(limit, fork)
            at = parent
        return False

    def _high_water(self) -> int:
        return self.step

    def _resume_from(self, chosen_id: str | None) -> None:
        if chosen_id is None:
            self.current, self.step = self._begin(None, 0), 0
            return
        timeline, step, _ = self.states[chosen_id]
        self.current, self.step = self._begin(timeline, step), step

    def _check_choice(self, chosen_id: str | None) -> None:
        if chosen_id is None:
            return
        timeline, step, _ = self.states[chosen_id]
        assert self._live(timeline, step), "a state of an abandoned timeline was chosen"
        assert step <= self._high_water(), "chosen past the current timeline's high-water mark"

    def _write(self, timeline: str, step: int, kind: str) -> None:
        made = (copy_in_memory(self.root, self.shm, step, timeline) if kind == "memory"
                else save_on_disk(self.root, step, timeline))
        # One folder a step: a state the new one replaced is gone.
        self.states = {i: s for i, s in self.states.items() if s[1] != step}
        self.states[made] = (timeline, step, kind)

    # -- what a run meets ---------------------------------------------------------------------

    @rule(steps=st.integers(1, 12), kind=KINDS)
    def train_and_save(self, steps: int, kind: str) -> None:
        self.step += steps
        self._write(self.current, self.step, kind)

    @rule(steps=st.integers(1, 12), kind=KINDS)
    def begin_a_save(self, steps: int, kind: str) -> None:
        self.step += steps
        self.in_flight.append((self.current, self.step, kind))

    @precondition(lambda self: bool(self.in_flight))
    @rule(data=st.data())
    def commit_late(self, data: st.DataObject) -> None:
        """A save commits after the history moved on (a rollback may have abandoned it)."""
        timeline, step, kind = self.in_flight.pop(data.draw(st.integers(0, len(self.in_flight)
                                                                       - 1)))
        if any(s[1] == step and self._live(s[0], s[1]) for s in self.states.values()):
            return  # the live history saved that step since: the late save is cleaned
        self._write(timeline, step, kind)

    @rule(back=st.integers(0, 30))
    def promote(self, back: int) -> None:
        self.catalog.promote(healthy_step=self.step, probation_steps=back)

    @rule(back=st.integers(0, 40), window=st.integers(0, 20))
    def anomaly(self, back: int, window: int) -> None:
        self.catalog.mark_anomaly(max(0, self.step - back), window, "spike")

    @precondition(lambda self: bool(self.states))
    @rule(data=st.data())
    def corrupt(self, data: st.DataObject) -> None:
        # By the order they were made: ids are random, and a draw must not depend on them.
        victim = list(self.states)[data.draw(st.integers(0, len(self.states) - 1))]
        self.catalog.mark_corrupt(self.states[victim][1], "flipped byte")

    @rule(back=st.integers(0, 40))
    def roll_back(self, back: int) -> None:
        onset = max(1, self.step - back)
        chosen = self.catalog.choose_for_rollback(onset).checkpoint
        self._check_choice(chosen.id if chosen else None)
        self._resume_from(chosen.id if chosen else None)
        self.in_flight.clear()  # the attempt's ranks are gone; what they left is cleaned

    @rule()
    def relaunch(self) -> None:
        chosen = self.catalog.choose_for_rollback(None, allow_pending=True).checkpoint
        self._check_choice(chosen.id if chosen else None)
        self._resume_from(chosen.id if chosen else None)
        self.in_flight.clear()

    @rule()
    def takeover(self) -> None:
        """The supervisor died; a new one reads the folder afresh and resumes the newest live
        state."""
        self.catalog = self._reader()
        chosen = self.catalog.choose_for_rollback(None, allow_pending=True).checkpoint
        self._check_choice(chosen.id if chosen else None)
        self._resume_from(chosen.id if chosen else None)

    @rule()
    def supervisor_crash(self) -> None:
        """Died between two steps of its own, nothing chosen: the next reader sees the same."""
        self.catalog = self._reader()

    @rule(keep=st.integers(0, 3))
    def retain(self, keep: int) -> None:
        newest = self._newest_live()
        self.catalog.retain(keep)
        on_disk = {c.id for c in self.catalog.checkpoints()}
        assert newest is None or newest in on_disk, "retention deleted the newest live state"
        self.states = {i: s for i, s in self.states.items() if i in on_disk}

    # -- invariants ---------------------------------------------------------------------------

    def _newest_live(self) -> str | None:
        corrupt = {c.id for c in self.catalog.checkpoints() if c.verdict is Verdict.CORRUPT}
        live = [(s[1], i) for i, s in self.states.items()
                if self._live(s[0], s[1]) and i not in corrupt]
        return max(live)[1] if live else None

    @invariant()
    def the_newest_live_state_is_on_disk(self) -> None:
        newest = self._newest_live()
        assert newest is None or newest in {c.id for c in self.catalog.checkpoints()}

    @invariant()
    def the_store_and_the_model_agree_on_what_is_live(self) -> None:
        for c in self.catalog.checkpoints():
            if c.id in self.states:
                assert c.fenced == (not self._live(*self.states[c.id][:2]))


Store.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                   suppress_health_check=[HealthCheck.too_slow])
test_the_store_under_random_histories = Store.TestCase
