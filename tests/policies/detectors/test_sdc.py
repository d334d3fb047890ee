"""The SDC comparison: per-rank digests in, the ranks that disagree out."""

from __future__ import annotations

import json

from babysit.policies.detectors import SdcConfig, SdcDetector
from babysit.policies.loader import load_policy
from babysit.policies.pipeline import Pipeline
from babysit.policies.types import Finding, Incident, Severity

P = "9f" * 32  # a 64-hex-digit parameter digest
Q = "a0" * 32
PROBE = "31" * 32
BAD_PROBE = "ee" * 32


def check(det: SdcDetector, step: int, digests: dict[int, dict[str, str]],
          world: int | None = None) -> Finding | None:
    """Every rank's report of one check, in rank order; the last call's finding."""
    world = len(digests) if world is None else world
    out = None
    for rank, d in digests.items():
        f = det.observe(rank, step, d, world)
        if f is not None:
            assert out is None
            out = f
    return out


def healthy(world: int) -> dict[int, dict[str, str]]:
    return {r: {"params": P, "probe": PROBE} for r in range(world)}


def test_agreeing_checks_find_nothing_and_are_tracked() -> None:
    det = SdcDetector()
    assert det.last_agreeing_step is None
    for step in (100, 200, 300):
        assert check(det, step, healthy(4)) is None
    assert det.last_agreeing_step == 300


def test_three_ranks_one_disagrees_it_is_named_by_majority() -> None:
    det = SdcDetector()
    check(det, 100, healthy(3))
    check(det, 200, healthy(3))
    bad = healthy(3)
    bad[2]["params"] = Q
    f = check(det, 300, bad)
    assert f is not None
    assert f.incident is Incident.SDC and f.severity is Severity.CRITICAL
    assert f.ranks == (2,) and f.step == 300 and f.onset_step == 201
    ev = f.evidence
    assert ev["check_step"] == 300 and ev["last_agreeing_step"] == 200
    assert ev["rules"] == ["majority"] and ev["keys"] == ["params"]
    assert ev["digests"]["params"] == {"0": P[:16], "1": P[:16], "2": Q[:16]}
    assert "params: rank 2 differs from the majority of 2/3" in f.message
    assert f.message.startswith("silent data corruption suspected at check step 300: rank 2 "
                                "disagrees (")
    json.dumps(f.to_json())
    assert Finding.from_json(json.loads(json.dumps(f.to_json()))) == f


def test_two_ranks_disagreeing_on_params_only_are_both_named() -> None:
    det = SdcDetector()
    check(det, 100, healthy(2))
    bad = healthy(2)
    bad[1]["params"] = Q
    f = check(det, 200, bad)
    assert f is not None and f.ranks == (0, 1)
    assert f.evidence["rules"] == ["no_majority"]
    assert "with 2 ranks the faulty one cannot be told apart by vote" in f.message


def test_two_ranks_the_probe_that_changed_on_its_own_device_names_the_bad_gpu() -> None:
    det = SdcDetector()
    check(det, 100, healthy(2))
    bad = healthy(2)
    bad[1] = {"params": Q, "probe": BAD_PROBE}  # the bad GPU also corrupted its parameters
    f = check(det, 200, bad)
    assert f is not None and f.ranks == (1,)
    assert f.evidence["rules"] == ["self"]
    assert f.evidence["self_changed"] == {"1": {"probe": {"first": PROBE[:16],
                                                          "now": BAD_PROBE[:16]}}}
    assert "cannot be told apart" not in f.message
    assert "rank 1's probe" in f.message


def test_a_device_wrong_from_its_first_probe_is_named_by_vote_not_trusted() -> None:
    det = SdcDetector()
    first = healthy(3)
    first[1]["probe"] = BAD_PROBE
    f = check(det, 100, first)
    assert f is not None and f.ranks == (1,) and f.evidence["rules"] == ["majority"]
    assert f.onset_step == 1  # nothing ever agreed
    # After a relaunch, rank 1 lands on a healthy device: its right answer is no "change".
    det.new_attempt()
    assert check(det, 100, healthy(3)) is None


def test_incomplete_checks_are_dropped_and_memory_is_bounded() -> None:
    det = SdcDetector(SdcConfig(max_pending=3))
    # Rank 1 never sends its digests of step 100 (it died mid-check, say).
    assert det.observe(0, 100, {"params": P}, 2) is None
    assert check(det, 200, healthy(2)) is None
    assert det.state_dict()["pending"] == {}
    # Its late report for the dropped check is ignored, not the start of a new one.
    assert det.observe(1, 100, {"params": Q}, 2) is None
    assert det.state_dict()["pending"] == {}
    # A rank that keeps reporting alone fills at most max_pending checks.
    for step in range(300, 1300, 100):
        det.observe(0, step, {"params": P}, 2)
    assert sorted(int(s) for s in det.state_dict()["pending"]) == [1000, 1100, 1200]


def test_keys_that_not_every_rank_sent_are_ignored() -> None:
    det = SdcDetector()
    digests = {0: {"params": P, "probe": PROBE, "optimizer": "11" * 32},
               1: {"params": P, "probe": PROBE, "optimizer": "22" * 32},
               2: {"params": P, "probe": PROBE}}
    assert check(det, 100, digests) is None
    assert det.last_agreeing_step == 100
    # No key common to all: nothing was compared, so nothing agreed either.
    assert check(det, 200, {0: {"a": P}, 1: {"b": Q}}) is None
    assert det.last_agreeing_step == 100


def test_one_report_per_episode_rearmed_by_agreement_or_a_new_attempt() -> None:
    det = SdcDetector()
    check(det, 100, healthy(3))
    bad = healthy(3)
    bad[2]["params"] = Q
    assert check(det, 200, bad) is not None
    assert check(det, 300, bad) is None  # same rank again: already reported
    worse = healthy(3)
    worse[2]["params"] = Q
    worse[0]["probe"] = BAD_PROBE
    f = check(det, 400, worse)
    assert f is not None and f.ranks == (0, 2)  # a new rank joined
    det.new_attempt()
    f = check(det, 200, bad)
    assert f is not None and f.onset_step == 101


def test_a_new_attempt_forgets_the_abandoned_future() -> None:
    # Agreed at 100..400, disagreed at 500, rolled back to a checkpoint at 200: the replayed
    # run's agreements at 300 and 400 are not known yet, so a disagreement at 400 onsets at 301.
    det = SdcDetector()
    for step in (100, 200, 300, 400):
        check(det, step, healthy(3))
    bad = healthy(3)
    bad[1]["params"] = Q
    assert check(det, 500, bad) is not None
    det.new_attempt()
    assert check(det, 300, healthy(3)) is None
    f = check(det, 400, bad)
    assert f is not None and f.onset_step == 301 and f.evidence["last_agreeing_step"] == 300


def test_reports_arrive_in_any_rank_order() -> None:
    det = SdcDetector()
    bad = healthy(3)
    bad[0]["params"] = Q
    assert det.observe(2, 100, bad[2], 3) is None
    assert det.observe(0, 100, bad[0], 3) is None
    f = det.observe(1, 100, bad[1], 3)
    assert f is not None and f.ranks == (0,)


def test_state_round_trip_mid_stream_changes_nothing() -> None:
    bad = healthy(2)
    bad[1]["probe"] = BAD_PROBE
    events = [(r, s, d) for s, ds in ((100, healthy(2)), (200, healthy(2)), (300, bad),
                                      (400, bad), (500, healthy(2)), (600, bad))
              for r, d in ds.items()]

    def run(det: SdcDetector, evs: list[tuple[int, int, dict[str, str]]]) -> list[tuple]:
        return [(f.step, f.ranks, f.onset_step) for r, s, d in evs
                if (f := det.observe(r, s, d, 2)) is not None]

    whole = run(SdcDetector(), events)
    assert whole == [(300, (1,), 201), (600, (1,), 501)]
    for cut in range(len(events) + 1):
        first = SdcDetector()
        got = run(first, events[:cut])
        second = SdcDetector()
        second.load_state_dict(json.loads(json.dumps(first.state_dict())))
        assert got + run(second, events[cut:]) == whole


def test_checked_step_moves_when_a_check_completes() -> None:
    det = SdcDetector()
    assert det.checked_step is None
    det.observe(0, 100, {"params": P}, 2)
    assert det.checked_step is None
    det.observe(1, 100, {"params": P}, 2)
    assert det.checked_step == 100
    det.new_attempt()
    assert det.checked_step is None


def test_the_default_policy_rolls_back_without_skipping() -> None:
    det = SdcDetector()
    check(det, 100, healthy(2))
    bad = healthy(2)
    bad[0]["probe"] = BAD_PROBE
    f = check(det, 200, bad)
    assert f is not None and f.ranks == (0,)
    d = Pipeline(load_policy("default", {})).decide(f, now=0.0)
    assert d.action == "rollback" and d.onset_step == 101
    assert d.remedy["skip_before"] == d.remedy["skip_after"] == 0
    assert d.remedy["lr_scale"] == 1.0
