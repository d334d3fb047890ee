"""The supervisor's side of checkpoints: verdicts as the run goes, and where a relaunch resumes.

The loop calls these at fixed points; each returns journal entries (event name, fields) so
every verdict and every refusal is on the record:

    on_checkpoint(step)      a rank reported a committed checkpoint  -> retention
    on_progress(step)        healthy steps went by                   -> pending ones become good
    on_finding(finding, ...) an acted-on anomaly began at its onset   -> nearby ones become suspect
    shelf()                  a finding is about to be judged         -> the checkpoints, plainly
    resume_for(remedy)       a relaunch is about to start            -> which checkpoint, verified
    begin(attempt, resume)   it starts                               -> its timeline; fenced go

Which checkpoint a rollback or a relaunch may use is decided in ``policies/rollback.py``
(``resume_bound``, ``suspect_window``, ``can_roll_back``); this module reads and writes the
catalog on disk around those rules. A torn or corrupted checkpoint is refused, marked corrupt,
and the next older one is tried.
"""

from __future__ import annotations

from typing import Any

from babysit.checkpoints import (
    Catalog,
    Checkpoint,
    RollbackChoice,
    Verdict,
    lineage,
    memory,
    tiers,
)
from babysit.checkpoints.tiers import tier_of
from babysit.policies import rollback
from babysit.policies.rollback import Saved, Shelf
from babysit.policies.types import Action, Finding, Remedy
from babysit.policies.wording import said_ranks
from babysit.supervisor.contract.directive import Resume
from babysit.supervisor.run.journal import checkpoint_step

Entry = tuple[str, dict[str, Any]]

_PROMOTE_EVERY = 10
"""Steps between promotion passes: each pass re-reads the catalog from disk."""


def _storage_error(during: str, exc: OSError) -> Entry:
    """The catalog's disk failed (full, gone, read-only): journal it and carry on, so a storage
    fault costs checkpoints, never the supervisor."""
    return ("checkpoint_storage_error", {"during": during, "error": f"{exc.strerror or exc}",
                                         "path": exc.filename})


class Recovery:
    def __init__(self, catalog: Catalog, probation_steps: int, keep: int,
                 sdc_checks: bool = False) -> None:
        """``sdc_checks``: the run compares replicas (``sdc.every_steps``), so a checkpoint is
        promoted only once a check at or after its step agreed (``vouch``): a corrupted
        replica can pass probation with a healthy loss, and retention keeps only the newest
        good checkpoint beyond the newest few, which must be one from before the corruption."""
        self.catalog = catalog
        self.probation_steps = probation_steps
        self.keep = keep
        self.vouched: int | None = -1 if sdc_checks else None
        """The newest step an SDC check agreed at (-1: none yet); None: no SDC checks."""
        self.kept: int | None = None
        """The step of the just-in-time state saved since the last launch, if any: the state
        the fault's ranks held, which the relaunch may resume from however far the job's
        merged steps lag behind it (a lost node's last summaries never come)."""
        self.resumed_timeline: str | None = None
        """The timeline of the state the last choice resumes from (``begin`` forks from it)."""
        self.unwatched: tuple[int, int] | None = None
        """Steps ``a < s <= b`` no supervisor observed (set by ``resume_latest`` on a
        takeover): checkpoints whose probation fell there stay pending."""
        self._next_promotion = 0
        self._copies: dict[tuple[int, str | None], dict[int, memory.Part]] = {}
        """The memory copies whose parts are coming in, by step and timeline: each rank's
        part."""

    EVENTS = ("checkpoint_saved", "finding", "sdc_check", "just_in_time")
    """The journal entries it hears (``hear``)."""

    def hear(self, entry: dict[str, Any]) -> list[Entry]:
        """A journal entry of ``EVENTS``: a saved checkpoint, just-in-time ones too (retention),
        a finding acted on
        (checkpoints near its onset turn suspect), an SDC check (the step it vouches for).
        Returns the entries to journal in turn."""
        event, step = entry["event"], checkpoint_step(entry)
        if event == "just_in_time" and entry.get("outcome") == "saved":
            self.kept = step
        if step is not None and (event == "checkpoint_saved" or (
                event == "just_in_time" and entry.get("outcome") == "saved")):
            return self.on_checkpoint(step)
        if event == "finding":
            finding = Finding.from_json(entry["finding"])
            return self.on_finding(finding, Remedy.from_json(entry["remedy"], finding))
        if event == "sdc_check":
            self.vouch(entry.get("last_agreeing_step"))
        return []

    def memory_part(self, rank: int, data: dict[str, Any], world_size: int) -> list[Entry]:
        """A rank's part of a memory copy (its ``memory_copy`` event): once every rank of the
        job sent its part of the copy of a step, it is committed to the catalog (and older
        copies that never completed are forgotten). The journal's ``memory_copy`` entry."""
        part = memory.Part.from_event(rank, data)
        step = int(data.get("step", 0))
        key = (step, part.timeline)  # a copy is its step in its timeline
        parts = self._copies.setdefault(key, {})
        parts[rank] = part
        if len(parts) < world_size:
            return []
        del self._copies[key]
        for older in [k for k in self._copies if k[0] < step or k[1] != part.timeline]:
            del self._copies[older]
        place = self.catalog.memory
        try:
            manifest = memory.commit(self.catalog.root, step, parts, world_size,
                                     place.folder if place is not None else "")
        except OSError as exc:
            return [_storage_error("committing a memory copy", exc)]
        held = manifest.memory or {}
        entry = ("memory_copy", {
            "checkpoint_step": step, "bytes": manifest.total_bytes, "nodes": held.get("nodes"),
            "replicas": any(len(n) > 1 for n in held.get("holders", {}).values()),
            "stall_s": held.get("stall_s"), "write_s": held.get("write_s")})
        return [entry, *self.on_checkpoint(step)]

    def vouch(self, step: int | None) -> None:
        """Every replica agreed at ``step`` (the newest agreeing check, after a relaunch too)."""
        if self.vouched is not None and step is not None:
            self.vouched = step

    def on_checkpoint(self, step: int) -> list[Entry]:
        try:
            deleted = self.catalog.retain(self.keep)
        except OSError as exc:
            return [_storage_error("retention", exc)]
        return [("checkpoint_retention", {"deleted": [str(p) for p in deleted]})] if deleted else []

    def on_progress(self, step: int) -> list[Entry]:
        if step < self._next_promotion:
            return []
        self._next_promotion = step + _PROMOTE_EVERY
        healthy = step
        if self.vouched is not None:  # and only checkpoints at or before the agreeing check
            healthy = min(step, self.vouched + self.probation_steps)
        try:
            promoted = self.catalog.promote(healthy, self.probation_steps, self.unwatched)
            if promoted:
                # A newer good checkpoint exists: the one pinned for the last rollback may go.
                self.catalog.unpin()
        except OSError as exc:
            return [_storage_error("promotion", exc)]
        return [("checkpoint_verdict", {"checkpoint_step": c.step, "verdict": "good",
                                        "healthy_step": step, "created": c.manifest.created})
                for c in promoted]

    def on_finding(self, finding: Finding, remedy: Remedy) -> list[Entry]:
        """Checkpoints near an anomaly's onset become suspect, but only when babysit acts on it
        (rolls back, relaunches or stops): a spike that heals by itself, or a grad spike whose
        step was skipped in-process, left the weights as good as they were."""
        window = rollback.suspect_window(finding.incident, self.probation_steps)
        if window is None or remedy.action not in (Action.ROLLBACK, Action.RELAUNCH,
                                                   Action.STOP):
            return []
        reason = f"{finding.incident.value} with onset at step {finding.onset_step}"
        try:
            marked = self.catalog.mark_anomaly(finding.onset_step, window, reason)
        except OSError as exc:
            return [_storage_error("marking suspects", exc)]
        # The returned checkpoints carry their verdict from before the call: journal changes only.
        return [("checkpoint_verdict", {"checkpoint_step": c.step, "verdict": "suspect",
                                        "reason": reason})
                for c in marked if c.verdict is not Verdict.SUSPECT]

    def begin(self, attempt: int, resume: Resume | None, restored: int | None = None
              ) -> tuple[lineage.Chain, list[Entry]]:
        """``attempt`` starts: its timeline, forked from the state it resumes from (``resume``;
        stdout mode: the script's own checkpoint of step ``restored``, in the timeline that
        saved it; neither: a root), recorded before its ranks start, and the states that fork
        abandoned swept by retention, first of all. A plain start (no resume) begins the run's
        lineage anew: the states already in the folder are another run's, never chosen and
        never deleted. The chain goes to the ranks in the directive. Returns it and the
        journal's ``timeline`` entry."""
        try:
            history = self.catalog.history()
            if resume is not None:
                parent, fork = self.resumed_timeline, resume.step
            elif restored is not None:
                parent, fork = history.current, restored
            else:
                history, parent, fork = lineage.Lineage(), None, 0
            history = history.begin(parent, fork, attempt)
            lineage.write(self.catalog.root, history)
            fenced = [c.step for c in self.catalog.checkpoints() if c.fenced and not c.foreign]
        except OSError as exc:
            return (), [_storage_error("recording the run's lineage", exc)]
        chain = history.chain()
        entry = ("timeline", {"timeline": history.current, "parent": parent, "fork_step": fork,
                              "chain": [list(link) for link in chain], "fenced_steps": fenced})
        return chain, [entry, *(self.on_checkpoint(fork) if fenced else [])]

    def shelf(self) -> Shelf:
        """The live checkpoints as the rules judge a finding by them (``Known.shelf``).
        Storage that cannot be read offers none: a spike then alerts instead of rolling back
        (a NaN still rolls back, from scratch if need be)."""
        try:
            listed = self.catalog.live()
        except OSError:
            listed = []
        return Shelf(tuple(Saved(c.step, c.cursor, c.verdict is Verdict.GOOD,
                                 tier_of(c.manifest).relaunch_only) for c in listed),
                     self.probation_steps)

    def resume_for(self, remedy: Remedy | None, replayed: tuple[int, int] | None = None,
                   newest: int = 0) -> tuple[Resume | None, list[Entry]]:
        """The checkpoint the next attempt starts from (None: from scratch), and what was
        refused on the way. Also cleans checkpoints a killed attempt left half-written.

        ``newest``: the newest step any rank of the stopped attempt reported. A relaunch (which
        may take the newest checkpoint) may take one saved up to there, though the steps the
        finding is dated with lagged behind it: retraining those steps would save the same
        step twice.

        ``replayed``: ``(after_step, upto_cursor)`` of the data's rollback after a rerun that
        reproduced its anomaly (``Watch.replayed``): the rerun trained the steps after
        ``after_step`` on the very batches this remedy trains on before its skip range (which
        starts at ``upto_cursor``), so a checkpoint it saved there is as good as the one it
        started from plus those steps: the newest such is taken (a suspect one made pending),
        and the remedy does not train them a third time. None found: the rule below."""
        entries: list[Entry] = []
        self.resumed_timeline = None
        try:
            cleaned = self.catalog.clean_incomplete()
        except OSError as exc:
            cleaned = []
            entries.append(_storage_error("cleaning incomplete checkpoints", exc))
        if cleaned:
            entries.append(("checkpoint_cleaned", {"paths": [str(p) for p in cleaned]}))
        if remedy is None:
            return None, entries
        if replayed is not None:
            after, upto = replayed
            detected = remedy.finding.step
            reason = (f"replayed by the rerun of steps {after + 1}-{detected} on the "
                      f"batches its remedy trains on (before batch {upto})")
            try:
                choice = self.catalog.choose_trained_on(after, detected + 1, upto, reason)
            except OSError as exc:
                entries.append(_storage_error("choosing a checkpoint", exc))
            else:
                resume = self._chosen(choice, entries, before=detected + 1,
                                      extra={"replayed": reason})
                if resume is not None:
                    return resume, entries
        before, allow_pending = rollback.resume_bound(remedy)
        if allow_pending:  # up to the newest step reported, and this fault's own kept state
            before = max(before, newest + 1, (self.kept or 0) + 1)
        self.kept = None
        return self._choose(before, allow_pending, entries)

    def resume_latest(self, watched_until: int | None = None
                      ) -> tuple[Resume | None, list[Entry]]:
        """For a supervisor taking over a run whose supervisor died: the newest usable
        checkpoint, pending ones included (nothing suggests they are bad).

        ``watched_until``: the newest step the previous supervisor observed. The workers may
        have trained on unwatched after it; checkpoints whose probation steps fell between it
        and the resumed step were never observed, so they stay pending (journaled as such)
        instead of being promoted once the resumed run passes them."""
        _, entries = self.resume_for(None)
        # Any checkpoint will do: no bound. What a just-in-time one spared is counted up to
        # the newest step the dead supervisor saw.
        resume, entries = self._choose(None, True, entries, reached=None if watched_until is None
                                       else watched_until + 1)
        if watched_until is not None and resume is not None and resume.step > watched_until:
            self.unwatched = (watched_until, resume.step)
            try:
                blind = [c for c in self.catalog.checkpoints()
                         if c.verdict is Verdict.PENDING and c.step < resume.step
                         and c.step + self.probation_steps > watched_until]
            except OSError as exc:
                return resume, [*entries, _storage_error("listing checkpoints", exc)]
            entries += [("checkpoint_verdict", {
                "checkpoint_step": c.step, "verdict": "pending",
                "reason": f"written while no supervisor watched (steps {watched_until + 1}-"
                          f"{resume.step}): its probation steps were never observed"})
                for c in blind]
        return resume, entries

    def _choose(self, before: int | None, allow_pending: bool, entries: list[Entry],
                reached: int | None = None) -> tuple[Resume | None, list[Entry]]:
        """The newest usable checkpoint strictly before step ``before`` (None: any), journaled
        in ``entries``; ``reached`` (default ``before``) as in ``_chosen``."""
        try:
            choice = self.catalog.choose_for_rollback(before, allow_pending=allow_pending)
        except OSError as exc:
            entries.append(_storage_error("choosing a checkpoint", exc))
            entries.append(("resume", {"from": None, "before_step": before,
                                       "reason": "checkpoint storage unusable: starting over"}))
            return None, entries
        resume = self._chosen(choice, entries, before=before,
                              reached=before if reached is None else reached,
                              listed=self._listed())
        if resume is None:
            entries.append(("resume", {"from": None, "before_step": before,
                                       "reason": "no usable checkpoint: starting from scratch"}))
        return resume, entries

    def _listed(self) -> list[Checkpoint]:
        try:
            return self.catalog.live()
        except OSError:
            return []

    def _chosen(self, choice: RollbackChoice, entries: list[Entry], *, before: int | None,
                reached: int | None = None, extra: dict[str, Any] | None = None,
                listed: list[Checkpoint] | None = None) -> Resume | None:
        """The resume of the catalog's ``choice`` (None: none), its refusals and the choice
        journaled in ``entries``: ``before_step`` is ``before``, the bound it was chosen
        under (null: none). A just-in-time one says what it saved: the steps from it to
        ``reached`` (the first step the run had not completed; default ``before``) lost, and
        the newest periodic checkpoint it spared the run (``listed``: the catalog)."""
        for refusal in choice.refused:
            entries.append(("checkpoint_refused", {"checkpoint_step": refusal.step,
                                                   "path": str(refusal.path),
                                                   "problems": list(refusal.problems)}))
        chosen = choice.checkpoint
        if chosen is None:
            return None
        self.resumed_timeline = chosen.timeline
        verdict = chosen.verdict
        if extra is not None and verdict is Verdict.SUSPECT:  # made pending by the choice
            entries.append(("checkpoint_verdict", {"checkpoint_step": chosen.step,
                                                   "verdict": "pending", **extra}))
            verdict = Verdict.PENDING
        samples = chosen.manifest.samples
        reached = before if reached is None else reached
        jit = _just_in_time(chosen, reached, listed or []) or _memory(chosen, reached, listed or [])
        entries.append(("resume", {"from": str(chosen.path), "checkpoint_step": chosen.step,
                                   "origin": chosen.manifest.origin,
                                   "timeline": chosen.timeline,
                                   "cursor": chosen.cursor, "verdict": verdict.value,
                                   "before_step": before, **(extra or {}), **jit,
                                   **({"samples": samples} if samples is not None else {})}))
        if not tier_of(chosen.manifest).on_disk:
            place = self.catalog.memory
            return Resume(path=str(chosen.path), step=chosen.step, cursor=chosen.cursor,
                          samples=samples, memory=chosen.manifest.external_path,
                          verified_on=place.node if place is not None else None)
        external = chosen.manifest.external_path
        return Resume(path=external or str(chosen.path), step=chosen.step, cursor=chosen.cursor,
                      external=external is not None, samples=samples)



def _just_in_time(chosen: Checkpoint, reached: int | None,
                  listed: list[Checkpoint]) -> dict[str, Any]:
    """A just-in-time resume's own fields (what it was, who wrote it, what it spared: the steps
    from it to ``reached`` lost, null when ``reached`` is unknown, and the newest periodic
    checkpoint) and its one-line ``summary``; {} for another."""
    if tier_of(chosen.manifest) is not tiers.JUST_IN_TIME:
        return {}
    story = chosen.manifest.just_in_time or {}
    writers = [int(r) for r in story.get("writers", [])]
    periodic = max((c.step for c in listed if tier_of(c.manifest).lasting
                    and c.step < chosen.step), default=None)
    lost = max(0, reached - chosen.step) if reached is not None else None
    newest = f"the newest checkpoint was of step {periodic}" if periodic is not None \
        else "no checkpoint before it"
    spared = newest if lost is None else \
        f"{lost} step{'s' if lost != 1 else ''} lost; {newest}"
    streams = [int(r) for r in story.get("streams_lost") or []]
    fresh = f"; {said_ranks(streams)} resume{'s' if len(streams) == 1 else ''} with fresh " \
        "random streams" if streams else ""
    return {"just_in_time": {"writers": writers, "fault": story.get("fault"),
                             "marks": story.get("marks", []), "streams_lost": streams,
                             "periodic_step": periodic, "lost_steps": lost},
            "summary": f"resumed from the just-in-time state of step {chosen.step}, written by "
                       f"{said_ranks(writers)} after the {story.get('fault', 'fault')} "
                       f"({spared}){fresh}"}


def _memory(chosen: Checkpoint, reached: int | None,
            listed: list[Checkpoint]) -> dict[str, Any]:
    """A memory copy's resume's own fields (what it spared: the steps from it to ``reached``
    lost, null when unknown, and the newest checkpoint on disk) and its one-line ``summary``;
    {} for another."""
    if tier_of(chosen.manifest) is not tiers.IN_MEMORY:
        return {}
    on_disk = max((c.step for c in listed if tier_of(c.manifest).lasting
                   and c.step < chosen.step), default=None)
    lost = max(0, reached - chosen.step) if reached is not None else None
    newest = f"the newest checkpoint on disk was of step {on_disk}" if on_disk is not None \
        else "no checkpoint on disk before it"
    spared = newest if lost is None else f"{lost} step{'s' if lost != 1 else ''} lost; {newest}"
    nodes = (chosen.manifest.memory or {}).get("nodes", [])
    return {"memory": {"disk_step": on_disk, "lost_steps": lost, "nodes": nodes},
            "summary": f"resumed from the memory copy of step {chosen.step} ({spared})"}
