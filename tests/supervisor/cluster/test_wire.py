"""The babysitter-to-babysitter channel on real loopback sockets.

The raw helpers below speak the wire format from the module docstring by hand (not through
``supervisor.cluster.wire``), so the tests also pin the documented format and let a test play a
man in the middle: a client that knows the secret but writes forged, replayed or reflected frames,
or a fake leader that does not know it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import json
import math
import os
import socket
import struct
import sys
import termios
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from babysit.supervisor.cluster import AuthError, Listener, Peer, connect, parse_address
from babysit.supervisor.cluster.wire import MAX_FRAME
from tests.conftest import poll

SECRET = b"run-secret-0123456789abcdef"
NODE = {"node_rank": 1, "host": "node1", "pid": 4242}


def wait_for(condition: Callable[[], bool], timeout: float = 1.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


def mac(key: bytes, data: bytes) -> bytes:
    return hmac.new(key, data, hashlib.sha256).digest()


def write_plain(sock: socket.socket, message: dict[str, Any]) -> None:
    body = json.dumps(message).encode()
    sock.sendall(struct.pack(">I", len(body)) + body)


def read_exact(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        assert chunk, "connection closed"
        data += chunk
    return data


def read_plain(sock: socket.socket) -> dict[str, Any]:
    (length,) = struct.unpack(">I", read_exact(sock, 4))
    message: dict[str, Any] = json.loads(read_exact(sock, length))
    return message


def hung_up(sock: socket.socket) -> bool:
    """Whether the other end closed (a reset counts: it closes with our bytes still unread)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def frame(key: bytes, direction: bytes, seq: int, body: bytes) -> bytes:
    tag = mac(key, direction + struct.pack(">Q", seq) + body)
    return struct.pack(">I", len(body)) + tag + body


def raw_join(listener: Listener, secret: bytes = SECRET) -> tuple[socket.socket, bytes]:
    """A hand-written follower handshake; returns the socket and the session key."""
    sock = socket.create_connection(("127.0.0.1", listener.port), timeout=2)
    hello = read_plain(sock)
    assert hello["babysit"] == 1
    server_nonce, client_nonce = bytes.fromhex(hello["nonce"]), os.urandom(32)
    canonical = json.dumps(NODE, sort_keys=True, separators=(",", ":")).encode()
    join_mac = mac(secret, b"join|" + server_nonce + client_nonce + canonical)
    write_plain(sock, {**NODE, "nonce": client_nonce.hex(), "mac": join_mac.hex()})
    welcome = read_plain(sock)
    assert welcome["mac"] == mac(secret, b"welcome|" + client_nonce + server_nonce).hex()
    return sock, mac(secret, b"session|" + server_nonce + client_nonce)


def accept_one(listener: Listener) -> Peer:
    peers: list[Peer] = []
    deadline = time.monotonic() + 1.0
    while not peers:
        assert time.monotonic() < deadline, "no follower joined in time"
        peers += listener.accept()
        time.sleep(0.005)
    assert len(peers) == 1
    return peers[0]


def collect(peer: Peer, count: int) -> list[dict[str, Any]]:
    """Poll ``peer`` until ``count`` messages arrived."""
    return poll(peer.receive, count, timeout=1.0)


@pytest.fixture
def listener() -> Iterator[Listener]:
    with Listener("127.0.0.1", 0, SECRET) as lst:
        yield lst


@pytest.fixture
def pair(listener: Listener) -> Iterator[tuple[Peer, Peer]]:
    """(leader's end, follower's end) of one honest connection."""
    follower = connect(listener.address, SECRET, NODE, timeout_s=2)
    leader = accept_one(listener)
    yield leader, follower
    follower.close()


def test_messages_flow_both_ways_in_order_and_info_names_the_follower(
        listener: Listener, pair: tuple[Peer, Peer]) -> None:
    leader, follower = pair
    assert leader.info == {**NODE, "address": leader.info["address"]}
    assert leader.info["address"].startswith("127.0.0.1:")
    assert follower.info == {"address": listener.address, "local": "127.0.0.1"}
    before = leader.last_heard

    for i in range(300):
        assert follower.send({"type": "step", "step": i, "loss": 2.0 - i / 1000})
        assert leader.send({"type": "command", "n": i})
    assert follower.send({"type": "step", "loss": math.nan, "pad": "x" * 200_000})

    got_leader = collect(leader, 301)
    got_follower = collect(follower, 300)
    assert [m["step"] for m in got_leader[:300]] == list(range(300))
    assert math.isnan(got_leader[300]["loss"]) and len(got_leader[300]["pad"]) == 200_000
    assert [m["n"] for m in got_follower] == list(range(300))
    assert leader.last_heard > before
    assert not leader.closed and not follower.closed


@pytest.mark.skipif(sys.platform != "linux", reason="TCP_INFO is Linux's")
def test_the_kernel_measures_each_connections_round_trip(pair: tuple[Peer, Peer]) -> None:
    """``Peer.rtt``: TCP's smoothed round trip of what the connection carried (on loopback,
    microseconds), with no message of ours; None once the connection is closed."""
    leader, follower = pair
    for i in range(20):
        assert follower.send({"type": "step", "step": i})
        assert leader.send({"type": "beat"})
    collect(leader, 20)
    rtt = leader.rtt()
    assert rtt is not None and 0.0 < rtt < 0.05, rtt
    follower.close()
    wait_for(lambda: leader.closed)
    assert leader.rtt() is None


def test_send_is_thread_safe(pair: tuple[Peer, Peer]) -> None:
    leader, follower = pair

    def sender(thread: int) -> None:
        for i in range(100):
            assert follower.send({"thread": thread, "i": i})

    threads = [threading.Thread(target=sender, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got = collect(leader, 400)
    for thread in range(4):
        assert [m["i"] for m in got if m["thread"] == thread] == list(range(100))
    assert not leader.closed


def test_a_follower_with_the_wrong_secret_is_refused(listener: Listener) -> None:
    with pytest.raises(AuthError, match="secret probably differs"):
        connect(listener.address, b"another run's secret", NODE, timeout_s=2)
    wait_for(lambda: listener.rejected["mac"] == 1)
    assert "mac" in listener.last_rejected and "127.0.0.1:" in listener.last_rejected
    assert listener.accept() == []


def test_a_leader_with_the_wrong_secret_is_refused() -> None:
    with Listener("127.0.0.1", 0, b"a stray leader") as stray, pytest.raises(AuthError):
        connect(stray.address, SECRET, NODE, timeout_s=2)


def fake_leader(reply: Callable[[socket.socket], None]) -> tuple[str, threading.Thread]:
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        sock, _ = server.accept()
        with sock:
            reply(sock)
            with contextlib.suppress(OSError):  # a reply that hung up itself
                sock.recv(1)  # hold the connection open until the client gives up
        server.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return f"127.0.0.1:{server.getsockname()[1]}", thread


def test_a_fake_leader_that_skips_the_proof_cannot_command() -> None:
    def welcome_anyone(sock: socket.socket) -> None:
        write_plain(sock, {"babysit": 1, "nonce": os.urandom(32).hex()})
        read_plain(sock)
        write_plain(sock, {"mac": mac(b"guess", b"welcome|").hex()})

    address, thread = fake_leader(welcome_anyone)
    with pytest.raises(AuthError, match="could not prove it knows the run secret"):
        connect(address, SECRET, NODE, timeout_s=2)
    thread.join(timeout=2)


def test_something_else_on_the_port_is_not_a_leader() -> None:
    address, thread = fake_leader(lambda sock: sock.sendall(b"\x00\x00\x00\x02hi"))
    with pytest.raises(AuthError, match="not a babysit leader"):
        connect(address, SECRET, NODE, timeout_s=2)
    thread.join(timeout=2)


def test_nobody_listening_raises_oserror() -> None:
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]
    with pytest.raises(ConnectionRefusedError):
        connect(f"127.0.0.1:{port}", SECRET, NODE, timeout_s=2)


def body(message: Any) -> bytes:
    return json.dumps(message).encode()


def flip(data: bytes, at: int) -> bytes:
    """``data`` with one bit changed at index ``at``."""
    changed = bytearray(data)
    changed[at] ^= 1
    return bytes(changed)


# Frames a man in the middle (who knows no key) or a buggy peer could produce, each after a
# valid frame 0, and why the leader closes: everything after the good frame is dropped.
FORGED: dict[str, Callable[[bytes], bytes]] = {
    "tag": lambda key: flip(frame(key, b"F", 1, body({"cmd": "stop"})), at=4),
    "body": lambda key: flip(frame(key, b"F", 1, body({"cmd": "stop"})), at=-3),
    "wrong_key": lambda key: frame(b"guessed key", b"F", 1, body({"cmd": "stop"})),
    "replay": lambda key: frame(key, b"F", 0, body({"good": 0})),
    "skip_ahead": lambda key: frame(key, b"F", 2, body({"cmd": "stop"})),
    "reflected": lambda key: frame(key, b"L", 1, body({"cmd": "stop"})),
    "json": lambda key: frame(key, b"F", 1, b"{not json"),
    "not_object": lambda key: frame(key, b"F", 1, body([1, 2])),
    "too_big": lambda key: struct.pack(">I", MAX_FRAME + 1) + bytes(32),
}
REASON = {name: "tag" for name in ("body", "wrong_key", "replay", "skip_ahead", "reflected")}


@pytest.mark.parametrize("forgery", sorted(FORGED))
def test_a_forged_frame_closes_the_connection_and_delivers_nothing(
        listener: Listener, forgery: str) -> None:
    sock, key = raw_join(listener)
    leader = accept_one(listener)
    with sock:
        sock.sendall(frame(key, b"F", 0, body({"good": 0})))
        sock.sendall(FORGED[forgery](key) + frame(key, b"F", 1, body({"after": 1})))
        wait_for(lambda: leader.closed)
        assert hung_up(sock)
    assert leader.receive() == [{"good": 0}]
    assert leader.close_reason == REASON.get(forgery, forgery)
    assert leader.send({"cmd": "launch"}) is False


def raw_lead(sock: socket.socket) -> bytes:
    """A hand-written leader handshake (it knows the secret); returns the session key."""
    server_nonce = os.urandom(32)
    write_plain(sock, {"babysit": 1, "nonce": server_nonce.hex()})
    client_nonce = bytes.fromhex(read_plain(sock)["nonce"])
    write_plain(sock, {"mac": mac(SECRET, b"welcome|" + client_nonce + server_nonce).hex()})
    return mac(SECRET, b"session|" + server_nonce + client_nonce)


def test_the_follower_refuses_a_reflected_or_forged_command() -> None:
    """A man in the middle replays the follower's own frame back at it, then forges one."""
    def reflect(sock: socket.socket) -> None:
        key = raw_lead(sock)
        sock.sendall(frame(key, b"L", 0, body({"cmd": "launch"})))
        own = read_exact(sock, 4 + 32 + len(b'{"step":1}'))
        sock.sendall(own + frame(b"no key", b"L", 1, body({"cmd": "stop"})))

    address, thread = fake_leader(reflect)
    follower = connect(address, SECRET, NODE, timeout_s=2)
    wait_for(lambda: follower.receive() == [{"cmd": "launch"}])
    assert follower.send({"step": 1})
    wait_for(lambda: follower.closed)
    assert follower.receive() == [] and follower.close_reason == "tag"
    assert follower.send({"step": 2}) is False
    thread.join(timeout=2)


@pytest.mark.parametrize("first_frame, reason", [
    (b"", "eof"),
    (struct.pack(">I", 5000), "too_big"),
    (struct.pack(">I", 9) + b"{not json", "malformed"),
    (struct.pack(">I", 2) + b"[]", "malformed"),
    (struct.pack(">I", 12) + b'{"hello": 1}', "malformed"),
])
def test_a_bad_join_is_counted_and_never_accepted(
        listener: Listener, first_frame: bytes, reason: str) -> None:
    with socket.create_connection(("127.0.0.1", listener.port), timeout=2) as sock:
        read_plain(sock)
        if first_frame:
            sock.sendall(first_frame)
        else:
            sock.shutdown(socket.SHUT_WR)
        wait_for(lambda: listener.rejected[reason] == 1)
    assert listener.accept() == [] and reason in listener.last_rejected


def test_a_silent_client_does_not_block_an_honest_one() -> None:
    with Listener("127.0.0.1", 0, SECRET, handshake_timeout_s=0.3) as listener, \
            socket.create_connection(("127.0.0.1", listener.port), timeout=2) as silent:
        started = time.monotonic()
        follower = connect(listener.address, SECRET, NODE, timeout_s=2)
        assert time.monotonic() - started < 0.3
        assert accept_one(listener).info["node_rank"] == 1
        read_plain(silent)  # the hello; then nothing from us
        wait_for(lambda: listener.rejected["timeout"] == 1)
        assert hung_up(silent)
        assert listener.accept() == []
        follower.close()


def test_send_on_a_closed_peer_returns_false(pair: tuple[Peer, Peer]) -> None:
    leader, follower = pair
    follower.close()
    follower.close()  # idempotent
    assert follower.closed and follower.send({"x": 1}) is False
    wait_for(lambda: leader.closed)
    assert leader.close_reason == "eof"
    assert all(leader.send({"x": i}) is False for i in range(10))


def test_closing_the_listener_closes_its_followers(listener: Listener) -> None:
    follower = connect(listener.address, SECRET, NODE, timeout_s=2)
    leader = accept_one(listener)
    listener.close()
    assert leader.closed
    wait_for(lambda: follower.closed)
    with pytest.raises(ConnectionRefusedError):
        connect(listener.address, SECRET, NODE, timeout_s=2)


def test_ipv6_addresses() -> None:
    assert parse_address("[::1]:29500") == ("::1", 29500)
    assert parse_address("node0:29500") == ("node0", 29500)
    for bad in ("node0", "node0:", ":29500", "node0:http", "node0:70000"):
        with pytest.raises(ValueError, match="host:port"):
            parse_address(bad)
    listener = Listener("::1", 0, SECRET)
    try:
        listener.open()
    except OSError:
        pytest.skip("no IPv6 loopback here")
    try:
        assert listener.address.startswith("[::1]:")
        follower = connect(listener.address, SECRET, NODE, timeout_s=2)
        assert accept_one(listener).info["address"].startswith("[::1]:")
        follower.close()
    finally:
        listener.close()


def test_a_leaders_last_words_survive_a_reset_and_a_failed_send() -> None:
    """A leader that sends its last frames and hangs up with a reset (what closing a socket
    with unread beats in it does): the follower's next send fails, yet every frame that arrived
    before the reset is still delivered, the last ("finish") included."""
    count = 2000

    def last_words(sock: socket.socket) -> None:
        key = raw_lead(sock)
        frames = [frame(key, b"L", i, body({"n": i})) for i in range(count - 1)]
        sock.sendall(b"".join(frames) + frame(key, b"L", count - 1, body({"type": "finish"})))
        unsent = bytearray(4)
        while True:  # every byte is in the follower's kernel before the reset
            fcntl.ioctl(sock, termios.TIOCOUTQ, unsent)
            if struct.unpack("i", unsent)[0] == 0:
                break
            time.sleep(0.001)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()

    address, thread = fake_leader(last_words)
    follower = connect(address, SECRET, NODE, timeout_s=2)
    deadline = time.monotonic() + 5
    while follower.send({"type": "beat"}):
        assert time.monotonic() < deadline, "the reset never reached the follower"
        time.sleep(0.001)
    wait_for(lambda: follower.closed, timeout=5)
    got = follower.receive()
    assert len(got) == count and got[-1] == {"type": "finish"}
    assert follower.send({"type": "beat"}) is False
    thread.join(timeout=2)
