"""``host:port`` addresses in the config: a leader, a rendezvous endpoint (IPv6 in brackets)."""

from __future__ import annotations


def format_address(host: str, port: int) -> str:
    """``host:port``, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_address(address: str) -> tuple[str, int]:
    """Split ``host:port`` or ``[v6]:port``; raises ``ValueError`` with the expected form."""
    host, sep, port = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"leader address {address!r} is not host:port; write it as "
                         "node0:29500, or [::1]:29500 for an IPv6 address")
    return host, int(port)
