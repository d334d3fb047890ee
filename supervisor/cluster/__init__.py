"""Multi-node runs: one babysitter per node, the node-rank-0 one leads.

``wire`` is the authenticated channel between them (handshake, frames, threat model);
``messages`` declares what travels on it, and encodes and decodes it.
"""

from babysit.supervisor.cluster.wire import (
    MAX_FRAME,
    AuthError,
    Listener,
    Peer,
    connect,
)
from babysit.supervisor.config.address import format_address, parse_address

__all__ = [
    "MAX_FRAME",
    "AuthError",
    "Listener",
    "Peer",
    "connect",
    "format_address",
    "parse_address",
]
