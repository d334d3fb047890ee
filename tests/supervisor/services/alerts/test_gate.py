"""SinkGate: de-duplication and rate limiting as pure logic, with time as a plain number."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from babysit.supervisor.services.alerts import GateVerdict, SinkGate


def gate(dedup: float = 600.0, max_alerts: int = 100, window: float = 600.0) -> SinkGate:
    return SinkGate(dedup_window_s=dedup, max_alerts=max_alerts, window_s=window)


def test_same_key_within_the_window_is_suppressed_and_counted() -> None:
    g = gate(dedup=60)
    assert g.admit("hang", 0).verdict is GateVerdict.SEND
    assert g.admit("hang", 10).duplicates == 1
    second = g.admit("hang", 59.9)
    assert second.verdict is GateVerdict.DUPLICATE and second.duplicates == 2
    assert g.admit("spike", 20).verdict is GateVerdict.SEND  # other keys are unaffected


def test_the_window_runs_from_the_last_send_so_a_persistent_problem_is_re_announced() -> None:
    g = gate(dedup=60)
    g.admit("hang", 0)
    for t in range(10, 60, 10):
        assert g.admit("hang", t).verdict is GateVerdict.DUPLICATE
    reminder = g.admit("hang", 60)
    assert reminder.verdict is GateVerdict.SEND and reminder.duplicates == 5
    assert g.admit("hang", 61).duplicates == 1  # the count restarts after the reminder


def test_zero_dedup_window_sends_every_repeat() -> None:
    g = gate(dedup=0)
    assert [g.admit("k", t).verdict for t in (0, 0, 0)] == [GateVerdict.SEND] * 3


def test_rate_limit_is_a_sliding_window_and_the_next_send_reports_the_drops() -> None:
    g = gate(max_alerts=2, window=60)
    assert g.admit("a", 0).verdict is GateVerdict.SEND
    assert g.admit("b", 30).verdict is GateVerdict.SEND
    assert g.admit("c", 40).rate_limited == 1
    assert g.admit("d", 59.9).rate_limited == 2
    after = g.admit("e", 60)  # "a" (t=0) has left the window; "b" (t=30) has not
    assert after.verdict is GateVerdict.SEND and after.rate_limited == 2
    assert g.admit("f", 61).verdict is GateVerdict.RATE_LIMITED
    assert g.admit("f", 61).rate_limited == 2  # still not sent, so not a duplicate either


def test_a_rate_limited_alert_is_not_later_treated_as_a_duplicate() -> None:
    g = gate(dedup=600, max_alerts=1, window=60)
    g.admit("a", 0)
    assert g.admit("b", 1).verdict is GateVerdict.RATE_LIMITED
    assert g.admit("b", 61).verdict is GateVerdict.SEND  # nobody has seen "b" yet


def test_duplicates_do_not_use_up_the_rate_limit() -> None:
    g = gate(dedup=600, max_alerts=2, window=60)
    g.admit("a", 0)
    for t in range(1, 20):
        g.admit("a", t)
    assert g.admit("b", 20).verdict is GateVerdict.SEND


def test_max_alerts_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="max_alerts"):
        gate(max_alerts=0)


events = st.lists(
    st.tuples(st.sampled_from("abcd"), st.floats(min_value=0, max_value=50)), max_size=200
)


@given(
    events,
    st.floats(min_value=0, max_value=200),
    st.integers(min_value=1, max_value=5),
    st.floats(min_value=1, max_value=200),
)
def test_invariants_hold_for_any_sequence(
    steps: list[tuple[str, float]], dedup: float, max_alerts: int, window: float
) -> None:
    g = gate(dedup=dedup, max_alerts=max_alerts, window=window)
    now, sends, sent_keys = 0.0, list[float](), dict[str, float]()
    pending_drops, reported_drops, limited = 0, 0, 0
    for key, dt in steps:
        now += dt
        d = g.admit(key, now)
        if d.verdict is GateVerdict.SEND:
            # never more than max_alerts sends within any window
            assert len([t for t in sends if t > now - window]) < max_alerts
            # never the same key twice within the dedup window
            assert key not in sent_keys or now - sent_keys[key] >= dedup
            sends.append(now)
            sent_keys[key] = now
            assert d.rate_limited == pending_drops
            reported_drops += pending_drops
            pending_drops = 0
        elif d.verdict is GateVerdict.RATE_LIMITED:
            pending_drops += 1
            limited += 1
            assert d.rate_limited == pending_drops
        else:
            assert now - sent_keys[key] < dedup
    # every drop is reported by a later send, or is still waiting for one
    assert reported_drops + pending_drops == limited


def test_remembered_keys_stay_bounded() -> None:
    g = gate(dedup=10, max_alerts=1_000_000, window=1)
    for i in range(20_000):
        g.admit(f"key-{i}", i * 0.01)  # 1,000 keys live in any 10 s window
    assert len(g._keys) <= SinkGate._MAX_KEYS + 1
