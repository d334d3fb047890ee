"""A slow link: one node's network round trip lagging the other nodes' for minutes.

A node whose link is slow (a NIC that came up at a tenth of its speed, a flapping port, a
congested uplink) holds every collective up, and every rank waits alike: neither step times nor
forward times single it out. What does is the network path itself. The leader's kernel measures
the round trip of each follower's connection as it carries that babysitter's summaries and
heartbeats (TCP's smoothed RTT, ``wire.Peer.rtt``); the leader puts the slowest node's against
the median of the others on each merged step (``SummaryRecord.slowest_link``, named by the
node's lowest rank), and this detector judges that spread exactly as ``slow_compute`` judges
the ranks' forwards: holding the job up in ``min_share`` of the time for half of ``window_s``
and still, named with what it costs the job (its step time now against before), and on a
multi-node leader weighed for eviction (``cluster.eviction.SlowCost``).

What it cannot see: the babysitters' path is the collectives' path only when both use the same
interface (gloo, or NCCL over sockets); a slow InfiniBand or NVLink path beside a healthy
Ethernet shows nowhere here. The leader's own link slows every follower's round trip alike
(no node stands out), and a run of two nodes has no other node to compare the one link with.
"""

from __future__ import annotations

from pydantic import Field

from babysit.policies.detectors.slow_compute import SlowComputeConfig, SlowComputeDetector
from babysit.policies.types import JobStep, Spread


class SlowLinkConfig(SlowComputeConfig):
    factor: float = Field(default=3.0, gt=1.0)
    """A step is slow when the slowest node's round trip is above factor x the nodes' median."""
    min_excess_s: float = Field(default=0.001, ge=0.0)
    """...and above it by at least this many seconds: a healthy link's round trip is tens of
    microseconds; a link at a tenth of its speed under the job's traffic adds milliseconds
    (2.6-9.5 ms at 1 Mbit/s here, the job 2.2x slower)."""


class SlowLinkDetector(SlowComputeDetector):
    """Names the node (by its lowest rank) whose link lags the others'; see the module
    docstring."""

    name = "slow_link"
    signal = "link"
    said = ("link", "link round trip")

    def __init__(self, config: SlowLinkConfig | None = None) -> None:
        super().__init__(config or SlowLinkConfig())

    @staticmethod
    def spread(record: JobStep) -> Spread | None:
        return record.slowest_link
