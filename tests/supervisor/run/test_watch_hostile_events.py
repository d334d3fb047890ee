"""Odd or hostile worker events reach pure code, never a supervisor crash: a rank's event is
authenticated (same uid, right token) but its contents are only as sane as its script."""

from __future__ import annotations

from typing import Any

import pytest

from babysit.policies.loader import load_policy
from babysit.supervisor.contract.protocol import WorkerEvent, positive
from babysit.supervisor.rank.api import _flops_per_token
from babysit.supervisor.run.cadence import CadenceAdvisor, replay_journal
from babysit.supervisor.run.watch import Watch


def fingerprint(rank: int, **data: Any) -> WorkerEvent:
    return WorkerEvent(rank=rank, type="fingerprint", time=0.0, data=data)


@pytest.mark.parametrize("data", [
    {}, {"step": "10", "digests": {"params": "a"}}, {"step": 10, "digests": ["a", "b"]},
    {"step": 10, "digests": None}, {"step": 10.5, "digests": {"params": "a"}},
])
def test_malformed_fingerprints_are_ignored(data: dict[str, Any]) -> None:
    watch = Watch(load_policy("default"), sdc_every=5)
    assert watch.observe_fingerprint(fingerprint(0, **data), world_size=2) is None


def test_a_rank_outside_the_world_or_odd_digest_values_do_not_break_a_check() -> None:
    watch = Watch(load_policy("default"), sdc_every=5)
    assert watch.observe_fingerprint(fingerprint(7, step=5, digests={"params": "a"}), 2) is None
    assert watch.observe_fingerprint(fingerprint(0, step=5, digests={"params": 1e400}), 2) is None
    check = watch.observe_fingerprint(fingerprint(1, step=5, digests={"params": "inf"}), 2)
    assert check is not None and check.step == 5 and check.ranks == 2


@pytest.mark.parametrize("value", [10**400, -1, 0, float("nan"), float("inf"), "1e9", True, None,
                                   [1]])
def test_mfu_inputs_that_are_not_positive_finite_numbers_are_dropped(value: Any) -> None:
    assert positive(value) is None


def test_attach_refuses_nonsense_with_its_own_message() -> None:
    assert _flops_per_token(None, 10) == 60.0
    for bad in ("many", 10**400, -5, float("nan")):
        with pytest.raises(ValueError, match="give a positive, finite number"):
            _flops_per_token(None, bad)


@pytest.mark.parametrize("blocking", [10**400, -1.0, float("nan"), "2.0", True, None])
def test_a_nonsense_checkpoint_cost_is_ignored_live_and_when_the_journal_is_replayed(
        blocking: Any) -> None:
    # Journaled once as the rank sent it, it is read back by every later babysit run in the
    # same run directory: it must never stop one from starting.
    advisor = CadenceAdvisor(5)
    advisor.on_checkpoint(blocking)
    replay_journal(advisor, [{"event": "checkpoint_saved", "time": 1.0, "attempt": 0,
                              "checkpoint_step": 5,
                              "data": {"blocking_s": blocking}}])
    advisor.on_step_time(0.1)
    assert advisor.advice() is None  # no cost known: no advice
