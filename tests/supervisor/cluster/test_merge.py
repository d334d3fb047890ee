"""The job-level view of a multi-node run: node summaries over JSON, the leader's merge, and the
global detectors watching merged summaries exactly as they watch one node's StepRecords."""

from __future__ import annotations

import json
import math
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from babysit.policies.loader import load_policy
from babysit.policies.pipeline import SCOPES, Pipeline
from babysit.policies.types import Finding, JobStep, RankStep, StepRecord
from babysit.supervisor.cluster.merge import NodeMerger
from babysit.supervisor.node.sketch import StepSummary, SummaryRecord

# -- helpers ----------------------------------------------------------------------------------


def rank_step(rank: int, step: int, **kw: Any) -> RankStep:
    fields: dict[str, Any] = {"loss": 2.0 + rank / 8, "grad_norm": 1.0 + rank / 16,
                              "lr": 1e-3, "tokens": 4096.0, "samples": 8.0,
                              "step_time": 0.5 + rank / 64, "data_wait": 0.0625}
    fields.update(kw)
    return RankStep(rank=rank, step=step, time=100.0 + step + rank / 1024, cursor=step,
                    **fields)


def summarise(reports: list[RankStep], step: int, world: int) -> StepSummary:
    summary = StepSummary(step, world)
    for r in reports:
        summary.add(r)
    return summary


def over_the_wire(summary: StepSummary) -> StepSummary:
    """What the leader holds after a follower sent ``summary``: strict JSON both ways."""
    text = json.dumps(summary.to_dict(), allow_nan=False)
    return StepSummary.from_dict(json.loads(text))


def text(row: dict[str, Any]) -> str:
    """A row as exact text: NaN compares equal to NaN, and floats to the last bit."""
    return json.dumps(row, sort_keys=True)


# -- the JSON round trip ----------------------------------------------------------------------


def test_two_nodes_over_the_wire_merge_into_the_summary_of_all_ranks() -> None:
    # Values are multiples of 1/64, so every sum is exact whatever the order it is taken in.
    world = 16
    odd: dict[int, dict[str, Any]] = {
        2: {"loss": math.nan, "grad_norm": math.inf, "lr": None},
        9: {"loss": -math.inf, "tokens": None, "samples": None, "step_time": None},
        11: {"step_time": 0.0, "data_wait": None, "skipped": True},
        13: {"loss": None, "grad_norm": None},
    }
    # Rank 5 dropped its report.
    reports = [rank_step(r, 7, **odd.get(r, {})) for r in range(world) if r != 5]
    whole = summarise(reports, 7, world)
    # Two nodes, ranks interleaved, one of them reporting rank 0 twice.
    node_a = summarise([r for r in reports if r.rank % 2 == 0], 7, world)
    node_a.add(rank_step(0, 7, loss=99.0))
    whole.add(rank_step(0, 7, loss=99.0))
    node_b = summarise([r for r in reports if r.rank % 2 == 1], 7, world)
    merged = over_the_wire(node_b)
    merged.merge(over_the_wire(node_a))
    assert text(merged.to_row(3)) == text(whole.to_row(3))
    assert text(merged.to_dict()) == text(whole.to_dict())
    row = merged.to_row(3)
    assert math.isnan(row["loss"]) and row["loss_nonfinite_ranks"] == [2, 9]
    assert math.isnan(row["grad_norm"])
    assert row["missing_ranks"] == [5] and (merged.n_ranks, merged.duplicates) == (15, 1)
    assert merged.lr == 1e-3 and merged.to_dict()["lr_rank"] == 0


def test_the_round_trip_is_exact_for_any_values_even_if_the_sums_are_not() -> None:
    # Arbitrary floats: merging in another order may round a sum differently, but sending a
    # summary over the wire changes nothing at all.
    rng = random.Random(11)
    reports = [rank_step(r, 3, loss=rng.lognormvariate(0, 1), step_time=rng.uniform(0.1, 2),
                         grad_norm=rng.uniform(0, 5), tokens=rng.uniform(1, 1e4))
               for r in range(40)]
    node_a = summarise(reports[:24], 3, 40)
    node_b = summarise(reports[24:], 3, 40)
    sent = over_the_wire(node_a)
    sent.merge(over_the_wire(node_b))
    node_a.merge(node_b)
    assert text(sent.to_row(0)) == text(node_a.to_row(0))
    assert sent.to_row(0) == pytest.approx(summarise(reports, 3, 40).to_row(0))


finite_or_not = st.one_of(
    st.integers(-4000, 4000).map(lambda i: i / 64),
    st.sampled_from([math.nan, math.inf, -math.inf]),
    st.none(),
)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(finite_or_not, finite_or_not, finite_or_not, st.integers(0, 2)),
                min_size=0, max_size=40),
       st.integers(0, 2**31))
def test_any_split_over_the_wire_equals_one_place(
        ranks: list[tuple[float | None, float | None, float | None, int]], seed: int) -> None:
    world = max(len(ranks), 1)
    reports = [rank_step(r, 4, loss=loss, grad_norm=grad, step_time=st_, tokens=None)
               for r, (loss, grad, st_, _) in enumerate(ranks)]
    whole = summarise(reports, 4, world)
    nodes = [summarise([r for r, (*_, node) in zip(reports, ranks, strict=True) if node == n],
                       4, world) for n in range(3)]
    random.Random(seed).shuffle(nodes)
    merged = over_the_wire(nodes[0])
    for node in nodes[1:]:
        merged.merge(over_the_wire(node))
    assert text(merged.to_row(1)) == text(whole.to_row(1))


def test_an_empty_summary_and_an_overflowed_sum_survive_strict_json() -> None:
    empty = StepSummary(step=2, world_size=4)
    back = over_the_wire(empty)
    assert back.time == -math.inf and back.n_ranks == 0
    assert text(back.to_row(0)) == text(empty.to_row(0))
    huge = summarise([rank_step(r, 2, loss=1e308) for r in range(3)], 2, 3)
    assert huge.loss.sum == math.inf
    assert over_the_wire(huge).loss.sum == math.inf


def test_a_node_of_a_large_world_sends_its_ranks_in_a_few_bytes() -> None:
    node = summarise([rank_step(r, 1) for r in range(4096, 4104)], 1, 8192)
    d = node.to_dict()
    assert d["ranks"] == [[4096, 4104]]
    assert len(json.dumps(d, allow_nan=False)) < 8192
    assert over_the_wire(node).missing_ranks(limit=3) == [0, 1, 2]


@pytest.mark.parametrize("bad", [
    {}, {"step": 1}, [], {**StepSummary(1, 2).to_dict(), "ranks": [[3, 1]]},
    {**StepSummary(1, 2).to_dict(), "stats": {"loss": {}}},
    {**StepSummary(1, 2).to_dict(), "world_size": "many"},
])
def test_a_malformed_summary_is_a_value_error(bad: Any) -> None:
    with pytest.raises(ValueError, match="not a StepSummary"):
        StepSummary.from_dict(bad)


def test_a_failed_merge_changes_nothing() -> None:
    a = summarise([rank_step(r, 1) for r in range(4)], 1, 8)
    b = summarise([rank_step(r, 1) for r in range(3, 6)], 1, 8)
    before = text(a.to_dict())
    assert a.shared_rank(b) == 3
    with pytest.raises(ValueError, match="rank 3 is in both"):
        a.merge(b)
    assert text(a.to_dict()) == before


# -- SummaryRecord reads like StepRecord -------------------------------------------------------

CASES: dict[str, list[RankStep]] = {
    "plain": [rank_step(r, 5) for r in range(6)],
    "nothing optional": [RankStep(rank=r, step=5, time=1.0) for r in range(3)],
    "some ranks without tokens or times": [
        rank_step(0, 5, tokens=None, step_time=None), rank_step(1, 5), rank_step(2, 5)],
    "nan loss and inf grad norm": [
        rank_step(0, 5), rank_step(1, 5, loss=math.nan), rank_step(2, 5, grad_norm=math.inf)],
    "inf loss": [rank_step(0, 5, loss=math.inf), rank_step(1, 5)],
    "zero step time": [rank_step(r, 5, step_time=0.0) for r in range(4)],
    "infinite step time": [rank_step(0, 5), rank_step(1, 5, step_time=math.inf)],
    "missing ranks": [rank_step(r, 5) for r in (1, 6)],
}


def same(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is b
    if not math.isfinite(a) or not math.isfinite(b):
        # StepRecord's max() gives inf where the summary says NaN; both mean "no number".
        return not math.isfinite(a) and not math.isfinite(b) and (
            math.isnan(a) or math.isnan(a) == math.isnan(b))
    return a == pytest.approx(b, rel=1e-12)


@pytest.mark.parametrize("declared", [(None, None), (6e9, 1e12), (6e9, None), (6e9, 0.0)])
@pytest.mark.parametrize("case", sorted(CASES))
def test_summary_record_reads_like_step_record(case: str,
                                               declared: tuple[float | None, ...]) -> None:
    fpt, peak = declared
    reports = CASES[case]
    world = 8
    record = StepRecord(step=5, time=max(r.time for r in reports), ranks=tuple(reports),
                        world_size=world, flops_per_token=fpt, peak_flops=peak)
    halves = [summarise(reports[::2], 5, world), summarise(reports[1::2], 5, world)]
    merged = over_the_wire(halves[0])
    merged.merge(over_the_wire(halves[1]))
    view: JobStep = SummaryRecord(merged, flops_per_token=fpt, peak_flops=peak)
    expected: JobStep = record
    for key in ("step", "time", "cursor", "world_size"):
        assert getattr(view, key) == getattr(expected, key), key
    for key in ("loss", "grad_norm", "step_time", "tokens", "tokens_per_s", "mfu"):
        assert same(getattr(view, key), getattr(expected, key)), (key, getattr(view, key),
                                                                  getattr(expected, key))


def test_summary_record_mfu_is_tokens_per_s_over_the_jobs_peak() -> None:
    reports = [rank_step(r, 1, tokens=1000.0, step_time=0.5) for r in range(4)]
    view = SummaryRecord(summarise(reports, 1, 4), flops_per_token=6.0, peak_flops=1e4)
    assert view.tokens_per_s == 8000.0
    assert view.mfu == pytest.approx(8000.0 * 6.0 / (1e4 * 4))


# -- pipelines by scope -----------------------------------------------------------------------


def spike_curve(steps: int = 160, spike_at: int = 120, ranks: int = 4, nodes: int = 2,
                ) -> list[list[list[RankStep]]]:
    """steps x nodes x that node's ranks: flat noisy loss, a 50x spike at one step."""
    rng = random.Random(5)
    out = []
    for step in range(1, steps + 1):
        per_node: list[list[RankStep]] = [[] for _ in range(nodes)]
        for r in range(ranks):
            loss = 2.5 * math.exp(rng.gauss(0, 0.01)) * (50.0 if step == spike_at else 1.0)
            per_node[r % nodes].append(rank_step(
                r, step, loss=loss, grad_norm=math.exp(rng.gauss(0, 0.1)),
                step_time=0.5 * math.exp(rng.gauss(0, 0.02)), tokens=2048.0))
        out.append(per_node)
    return out


def test_a_job_pipeline_on_merged_summaries_sees_what_one_pipeline_sees_on_every_rank() -> None:
    policy = load_policy("default")
    whole, job = Pipeline(policy), Pipeline(policy, scope="job")
    merger = NodeMerger({0, 1})
    seen_whole: list[Finding] = []
    seen_job: list[Finding] = []
    for per_node in spike_curve():
        ranks = sorted((r for node in per_node for r in node), key=lambda r: r.rank)
        record = StepRecord(step=ranks[0].step, time=max(r.time for r in ranks),
                            ranks=tuple(ranks), world_size=4)
        seen_whole += whole.findings(record)
        for node, reports in enumerate(per_node):
            summary = over_the_wire(summarise(reports, record.step, 4))
            for merged in merger.add(node, summary):
                seen_job += job.findings(SummaryRecord(merged))
    job_names = set(SCOPES["job"])
    assert seen_job == [f for f in seen_whole if f.detector in job_names]
    spikes = [f for f in seen_job if f.incident.value == "loss_spike"]
    # 50x the baseline: catastrophic, critical at once.
    assert [(f.step, f.onset_step, f.severity.name) for f in spikes] == [(120, 120, "CRITICAL")]
    assert spikes[0].evidence["ratio"] == pytest.approx(50.0, rel=0.05)


def test_the_job_pipeline_decides_on_a_summary_record() -> None:
    pipe = Pipeline(load_policy("default"), scope="job")
    decisions = []
    for per_node in spike_curve():
        merged = summarise(per_node[0], per_node[0][0].step, 4)
        merged.merge(summarise(per_node[1], merged.step, 4))
        decisions += pipe.observe(SummaryRecord(merged))
    assert [(d.step, d.detector) for d in decisions] == [(120, "loss_spike")]


def test_scopes_split_the_step_detectors() -> None:
    policy = load_policy("default")
    names = {scope: [d.name for d in Pipeline(policy, scope).detectors] for scope in SCOPES}
    assert names["node"] == ["nonfinite", "straggler", "rank_departure"]
    assert names["job"] == ["loss_spike", "grad_norm", "throughput", "slow_compute",
                            "slow_link"]
    assert names["all"] == [d.name for d in Pipeline(policy).detectors]
    assert sorted(names["node"] + names["job"]) == sorted(names["all"])
    with pytest.raises(ValueError, match="scope must be one of"):
        Pipeline(policy, scope="rack")


def test_only_a_job_pipeline_takes_a_summary_record() -> None:
    policy = load_policy("default")
    view = SummaryRecord(summarise([rank_step(0, 1)], 1, 1))
    assert Pipeline(policy, scope="job").findings(view) == []
    for scope in ("all", "node"):
        with pytest.raises(TypeError, match="scope='job'"):
            Pipeline(policy, scope=scope).findings(view)
    record = StepRecord(step=1, time=1.0, ranks=(rank_step(0, 1),), world_size=1)
    for scope in SCOPES:
        assert Pipeline(policy, scope=scope).findings(record) == []


def test_subset_state_round_trips_and_ignores_other_detectors() -> None:
    policy = load_policy("default")
    curve = spike_curve()
    records = []
    for per_node in curve:
        merged = summarise(per_node[0], per_node[0][0].step, 4)
        merged.merge(summarise(per_node[1], merged.step, 4))
        records.append(SummaryRecord(merged))
    whole = Pipeline(policy, scope="job")
    expected = [f for r in records for f in whole.findings(r)]
    first = Pipeline(policy, scope="job")
    got = [f for r in records[:115] for f in first.findings(r)]
    state = json.loads(json.dumps(first.state_dict()))
    assert sorted(state["detectors"]) == sorted(SCOPES["job"])
    # A state saved by an "all" pipeline carries per-rank detectors too: they are ignored.
    full = Pipeline(policy).state_dict()
    state["detectors"] = {**full["detectors"], **state["detectors"]}
    second = Pipeline(policy, scope="job")
    second.load_state_dict(state)
    got += [f for r in records[115:] for f in second.findings(r)]
    assert got == expected
    node = Pipeline(policy, scope="node")
    node.load_state_dict(full)
    assert sorted(node.state_dict()["detectors"]) == sorted(SCOPES["node"])


def test_new_attempt_renews_the_detectors_of_the_model_and_keeps_the_hardwares() -> None:
    # A relaunched attempt trains another model (an older checkpoint's, or a fresh one): no
    # baseline learnt on the abandoned stretch may judge it. Stragglers measure the hardware.
    policy = load_policy("default")
    for scope in SCOPES:
        pipe = Pipeline(policy, scope)
        before = {d.name: d for d in pipe.detectors}
        pipe.new_attempt()
        after = {d.name: d for d in pipe.detectors}
        assert list(after) == list(before)
        for name in after:
            kept = name in ("straggler", "nonfinite")
            assert (after[name] is before[name]) == kept, (scope, name)


# -- NodeMerger -------------------------------------------------------------------------------


def node_summary(node: int, step: int, per_node: int = 2, world: int = 8) -> StepSummary:
    ranks = range(node * per_node, (node + 1) * per_node)
    return summarise([rank_step(r, step) for r in ranks], step, world)


def emitted(out: list[StepSummary]) -> list[tuple[int, int]]:
    return [(s.step, s.n_ranks) for s in out]


def test_a_step_goes_out_once_every_node_sent_it() -> None:
    m = NodeMerger({0, 1, 2})
    assert m.add(0, node_summary(0, 1)) == []
    assert m.add(2, node_summary(2, 1)) == []
    out = m.add(1, node_summary(1, 1))
    assert emitted(out) == [(1, 6)]
    assert out[0].missing_ranks() == [6, 7]
    assert m.n_open == 0 and m.flush() == []


def test_a_step_one_node_never_sends_goes_out_when_it_moves_past() -> None:
    m = NodeMerger({0, 1})
    assert emitted(m.add(0, node_summary(0, 1)) + m.add(1, node_summary(1, 1))) == [(1, 4)]
    assert m.add(0, node_summary(0, 2)) == []
    assert m.add(0, node_summary(0, 3)) == []
    # Node 1 has no report of step 2 and goes straight to 3: step 2 is done, with node 0's.
    assert emitted(m.add(1, node_summary(1, 3))) == [(2, 2), (3, 4)]


def test_nodes_far_apart_in_time_still_merge_every_step() -> None:
    # Node 0's backlog is read first, then node 1's; then node 1 runs ahead.
    m = NodeMerger({0, 1})
    out = [s for step in range(1, 6) for s in m.add(0, node_summary(0, step))]
    assert out == []
    out = [s for step in range(1, 9) for s in m.add(1, node_summary(1, step))]
    assert emitted(out) == [(step, 4) for step in range(1, 6)]
    out = [s for step in range(6, 9) for s in m.add(0, node_summary(0, step))]
    assert emitted(out) == [(step, 4) for step in range(6, 9)]
    assert m.late == 0 and m.n_open == 0


def test_a_silent_node_holds_at_most_max_pending_steps_and_its_late_summaries_are_dropped(
) -> None:
    m = NodeMerger({0, 1}, max_pending=3)
    out = [s for step in range(1, 6) for s in m.add(0, node_summary(0, step))]
    assert emitted(out) == [(1, 2), (2, 2)]  # oldest first, as the fourth and fifth open
    assert m.n_open == 3
    assert m.add(1, node_summary(1, 2)) == [] and m.late == 1  # step 2 is gone
    # Node 1 catches up at step 4: step 3 (node 0 only) and 4 (both) are done.
    assert emitted(m.add(1, node_summary(1, 4))) == [(3, 2), (4, 4)]
    assert emitted(m.flush()) == [(5, 2)]
    assert m.add(1, node_summary(1, 5)) == [] and m.late == 2


def test_a_resent_summary_is_not_counted_twice() -> None:
    m = NodeMerger({0, 1})
    m.add(0, node_summary(0, 1))
    assert m.add(0, node_summary(0, 1)) == [] and m.duplicates == 1
    assert emitted(m.add(1, node_summary(1, 1))) == [(1, 4)]


def test_an_unexpected_node_is_merged_but_waited_for_by_nobody() -> None:
    m = NodeMerger({0})
    assert m.add(3, node_summary(3, 1)) == []
    assert emitted(m.add(0, node_summary(0, 1))) == [(1, 4)]
    assert emitted(m.add(0, node_summary(0, 2))) == [(2, 2)]


def test_a_node_leaving_releases_the_steps_that_waited_for_it() -> None:
    m = NodeMerger({0, 1})
    m.add(0, node_summary(0, 1))
    m.add(0, node_summary(0, 2))
    m.expected = {0}
    assert m.expected == frozenset({0})
    assert emitted(m.release()) == [(1, 2), (2, 2)]


def test_reset_starts_a_new_attempt_that_may_reuse_step_numbers() -> None:
    m = NodeMerger({0, 1})
    m.add(0, node_summary(0, 5))
    assert emitted(m.add(1, node_summary(1, 5))) == [(5, 4)]
    m.add(0, node_summary(0, 6))  # open when the attempt ends: forgotten
    m.reset({0, 1, 2})
    assert m.n_open == 0 and m.expected == frozenset({0, 1, 2})
    out = [s for n in (0, 1, 2) for s in m.add(n, node_summary(n, 3))]
    assert emitted(out) == [(3, 6)] and m.late == 0


def test_with_no_node_expected_every_step_goes_out_as_it_arrives() -> None:
    m = NodeMerger(())
    assert emitted(m.add(0, node_summary(0, 1))) == [(1, 2)]


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 4), st.integers(1, 12), st.integers(1, 6), st.data())
def test_any_interleaving_emits_each_step_once_in_order(
        nodes: int, steps: int, max_pending: int, data: st.DataObject) -> None:
    # Each node sends its steps in order, skipping some; the leader reads them in any
    # interleaving. Steps come out increasing, once each, and no rank is lost except in
    # summaries counted late.
    streams = {n: [s for s in range(1, steps + 1) if data.draw(st.booleans(), f"{n}/{s}")
                   or s == steps] for n in range(nodes)}
    m = NodeMerger(range(nodes), max_pending=max_pending)
    out: list[StepSummary] = []
    sent = 0
    cursors = dict.fromkeys(streams, 0)
    while any(cursors[n] < len(streams[n]) for n in streams):
        live = [n for n in streams if cursors[n] < len(streams[n])]
        n = data.draw(st.sampled_from(live))
        step = streams[n][cursors[n]]
        cursors[n] += 1
        sent += 1
        out += m.add(n, node_summary(n, step, world=2 * nodes))
        assert m.n_open <= max_pending
    out += m.flush()
    got = [s.step for s in out]
    assert got == sorted(set(got))
    assert sum(s.n_ranks for s in out) == 2 * (sent - m.late)
    if max_pending >= steps:  # nothing forced out early: every step complete, nothing late
        assert m.late == 0
        for s in out:
            assert s.n_ranks == 2 * sum(s.step in streams[n] for n in streams)
