"""A slow link: one node's network round trip lagging the others' for minutes
(``policies/detectors/slow_link.py``), on the spreads a multi-node leader puts on its merged
steps (``SummaryRecord.slowest_link``)."""

from __future__ import annotations

from babysit.policies.detectors.slow_link import SlowLinkConfig, SlowLinkDetector
from babysit.policies.types import Finding, Incident, RankStep, Spread, StepRecord
from babysit.supervisor.node.sketch import StepSummary, SummaryRecord

WORLD = 4
"""Four nodes of one rank: the leader (rank 0) and three followers, whose links it measures."""


def step(s: int, rtts: dict[int, float], step_time: float = 0.5) -> SummaryRecord:
    """Step ``s`` (one a second) as the leader merged it, with its followers' round trips
    (0.1 ms unless said), the slowest named by its node's rank."""
    ranks = tuple(RankStep(rank=r, step=s, time=float(s), step_time=step_time, data_wait=0.001)
                  for r in range(WORLD))
    every = sorted((rtts.get(node, 0.0001), node) for node in (1, 2, 3))
    value, node = every[-1]
    return SummaryRecord(StepSummary.of(s, WORLD, ranks),
                         slowest_link=Spread(rank=node, value=value, median=every[1][0],
                                             count=3))


def run(records: list[SummaryRecord], config: SlowLinkConfig | None = None) -> list[Finding]:
    """Each episode's first finding (a node told again as it goes on is ``slow_compute``'s)."""
    detector = SlowLinkDetector(config)
    return [f for r in records if (f := detector.observe(r)) is not None
            and not f.evidence["again"]]


def test_a_node_whose_link_is_slow_for_minutes_is_named_with_what_it_costs() -> None:
    """Node 2's round trip goes from 0.1 ms to 15 ms and the job's steps from 0.5 s to 0.8 s:
    named once, with the pace lost."""
    before = [step(s, {}) for s in range(1, 61)]
    slow = [step(s, {2: 0.015}, step_time=0.8) for s in range(61, 400)]
    [finding] = run(before + slow)
    assert finding.incident is Incident.STRAGGLER and finding.detector == "slow_link"
    assert finding.ranks == (2,) and finding.onset_step == 61
    ev = finding.evidence
    assert ev["signal"] == "link" and ev["link_s"] == 0.015 and ev["median_s"] == 0.0001
    assert ev["baseline_step_time_s"] == 0.5 and ev["slowdown"] == round(1 - 0.5 / 0.8, 4)
    assert "slow link at step" in finding.message
    assert "rank 2's link round trip 0.015s vs median 0.0001s" in finding.message


def test_a_jittery_round_trip_and_a_single_node_run_never_fire() -> None:
    """A busy host's kernel: some node's round trip at 0.8 ms now and then (under the 1 ms
    excess, and never the same node for long), 3x the others' at microseconds; and a one-node
    run, which has no links."""
    jitter = [step(s, {1 + s % 3: 0.0009 if s % 2 else 0.0003}) for s in range(1, 400)]
    assert run(jitter) == []
    single = [StepRecord(step=s, time=float(s), world_size=2,
                         ranks=tuple(RankStep(rank=r, step=s, time=float(s), step_time=0.5)
                                     for r in range(2))) for s in range(1, 400)]
    assert run(single) == []  # type: ignore[arg-type]


def test_its_state_survives_a_json_round_trip_and_keeps_the_link_signal() -> None:
    import json

    records = [step(s, {} if s <= 60 else {3: 0.02}, step_time=0.5 if s <= 60 else 0.9)
               for s in range(1, 400)]
    whole = run(records)
    first = SlowLinkDetector()
    for r in records[:100]:
        assert first.observe(r) is None
    second = SlowLinkDetector()
    second.load_state_dict(json.loads(json.dumps(first.state_dict())))
    rest = [f for r in records[100:] if (f := second.observe(r)) is not None
            and not f.evidence["again"]]
    assert [(f.step, f.ranks, f.evidence["slowdown"]) for f in rest] \
        == [(f.step, f.ranks, f.evidence["slowdown"]) for f in whole]


def test_a_signal_that_lags_the_slowdown_still_finds_the_pace_before() -> None:
    """A slow link's round trip climbs as its queue fills: the job's steps are slow 25 s before
    the round trip crosses the line. The pace before is the one marked a quarter of the window
    before the first slow step, not the slow steps in between."""
    before = [step(s, {}) for s in range(1, 201)]
    lagging = [step(s, {}, step_time=0.8) for s in range(201, 226)]
    slow = [step(s, {2: 0.008}, step_time=0.8) for s in range(226, 500)]
    [finding] = run(before + lagging + slow)
    assert finding.ranks == (2,) and finding.onset_step == 226
    assert finding.evidence["baseline_step_time_s"] == 0.5
