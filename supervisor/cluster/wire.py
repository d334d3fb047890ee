"""The authenticated channel between the babysitters of a multi-node run.

One babysitter per node; the node-rank-0 one is the *leader* and listens on TCP, the others are
*followers* and connect to it. Both sides exchange small JSON objects: followers send step
summaries, findings, events and heartbeats; the leader sends commands (launch, stop, finish).
What those objects are is declared once, in ``supervisor.cluster.messages``; this module only
carries them and vouches for who sent them.

Threat model. Every babysitter of a run knows a per-run secret (bytes). We defend against a stray
process on the same network that does not know it (it must neither join the run nor command it)
and against a man in the middle who can see and alter the traffic (he must not be able to alter,
inject, drop-and-reinject, reorder, replay or reflect a message without the connection closing).
Confidentiality is *not* a goal: telemetry and commands are not secret, and whoever needs it can
run the channel through a TLS or SSH tunnel. Nothing secret crosses the wire.

Handshake (plain frames ``u32 length | UTF-8 JSON``, at most ``MAX_HANDSHAKE`` bytes each, the
whole exchange bounded by a deadline)::

    leader   -> follower  {"babysit": 1, "nonce": Ns}
    follower -> leader    {"node_rank": int, "host": str, "pid": int, "nonce": Nc,
                           "mac": HMAC(secret, "join|" + Ns + Nc + canonical JSON of the node)}
    leader   -> follower  {"mac": HMAC(secret, "welcome|" + Nc + Ns)}

Nonces are 32 random bytes (hex on the wire, raw bytes inside the MACs); every HMAC is SHA-256.
The leader closes the connection on a bad ``mac``; the follower refuses a leader whose welcome
does not verify, so a fake leader cannot command it. Both then derive
``session key = HMAC(secret, "session|" + Ns + Nc)``, fresh for every connection.

Frames after the handshake::

    u32 body length | 32-byte tag | body (UTF-8 JSON object)
    tag = HMAC(session key, direction + u64 sequence + body)

``direction`` is ``b"L"`` leader to follower, ``b"F"`` follower to leader. Each direction counts
its own sequence from 0 and the receiver expects exactly the next number, so a replayed, dropped,
reordered or reflected frame fails to verify. A bad tag, bad JSON, a body that is not an object or
a length over ``MAX_FRAME`` closes the connection; nothing raises into the caller's thread.

Error tree::

    Exception
     └── AuthError   the handshake failed: wrong secret, or the other end is not a babysitter
    OSError          nobody listens, the network failed, the handshake timed out (retry)
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import hmac
import json
import os
import queue
import secrets
import socket
import struct
import sys
import threading
import time
from typing import Any

from babysit.supervisor.config.address import format_address, parse_address

VERSION = 1
NONCE_BYTES = 32
TAG_BYTES = 32
MAX_HANDSHAKE = 4096
"""Largest handshake frame, in bytes; a join is a few hundred."""
MAX_FRAME = 16 * 1024 * 1024
"""Largest frame body, in bytes; a larger length prefix closes the connection."""
MAX_PENDING = 32
"""Handshakes in progress at once; more connections are refused (reason ``busy``)."""
SEND_TIMEOUT_S = 30.0
"""How long one ``send`` may block on a peer that stopped reading before the peer counts as gone."""

LEADER = b"L"
FOLLOWER = b"F"

_TCP_INFO = getattr(socket, "TCP_INFO", None) if sys.platform == "linux" else None
_QUICKACK = getattr(socket, "TCP_QUICKACK", None) if sys.platform == "linux" else None
_TCPI_RTT = 68
"""Offset of ``tcpi_rtt`` (u32, microseconds: the smoothed round trip) in Linux's
``struct tcp_info``, where it has been since 2.6."""

_LENGTH = struct.Struct(">I")
_SEQUENCE = struct.Struct(">Q")
_NODE_FIELDS = ("node_rank", "host", "pid")
_ACCEPT_POLL_S = 0.2


class AuthError(Exception):
    """The handshake failed: the other end does not know the run's secret or is no babysitter."""


class _Refused(Exception):
    """A handshake failure on the leader side; ``reason`` is the label ``rejected`` counts."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def _canonical(node: dict[str, Any]) -> bytes:
    return json.dumps({k: node[k] for k in _NODE_FIELDS}, sort_keys=True,
                      separators=(",", ":")).encode()


def _recv_exact(sock: socket.socket, size: int, deadline: float | None) -> bytes | None:
    """Read exactly ``size`` bytes; None on EOF. With a deadline, raises TimeoutError past it;
    without one, waits through the socket's timeouts (the reader thread's idle periods)."""
    chunks: list[bytes] = []
    while size:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("handshake deadline passed")
            sock.settimeout(remaining)
        try:
            chunk = sock.recv(min(size, 1 << 20))
        except TimeoutError:
            if deadline is not None:
                raise
            continue
        if not chunk:
            return None
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def _send_plain(sock: socket.socket, message: dict[str, Any], deadline: float) -> None:
    body = json.dumps(message).encode()
    sock.settimeout(max(deadline - time.monotonic(), 0.001))
    sock.sendall(_LENGTH.pack(len(body)) + body)


def _recv_plain(sock: socket.socket, deadline: float) -> dict[str, Any] | None:
    """One handshake frame; None on EOF. Raises ``_Refused`` for a malformed or oversized one."""
    header = _recv_exact(sock, _LENGTH.size, deadline)
    if header is None:
        return None
    (length,) = _LENGTH.unpack(header)
    if length > MAX_HANDSHAKE:
        raise _Refused("too_big", f"handshake frame of {length} bytes (limit {MAX_HANDSHAKE})")
    body = _recv_exact(sock, length, deadline)
    if body is None:
        return None
    try:
        message = json.loads(body)
    except (UnicodeDecodeError, ValueError) as e:
        raise _Refused("malformed", f"handshake frame is not JSON: {e}") from None
    if not isinstance(message, dict):
        raise _Refused("malformed", "handshake frame is not a JSON object")
    return message


def _nonce(message: dict[str, Any], key: str = "nonce") -> bytes | None:
    value = message.get(key)
    if not isinstance(value, str) or len(value) != 2 * NONCE_BYTES:
        return None
    try:
        return bytes.fromhex(value)
    except ValueError:
        return None


class Peer:
    """One authenticated connection, on either side.

    Built by ``Listener`` and ``connect`` only. A daemon thread reads frames into a queue until
    EOF or the first bad frame, then marks the peer closed (``close_reason`` says why: ``eof``,
    ``tag``, ``json``, ``not_object``, ``too_big``, ``error``, ``closed``). ``send`` may be
    called from any thread; ``receive`` is meant for one consumer. A send that finds the other
    side hung up sends nothing more, but ``closed`` waits for the reader: what the other side
    sent before it hung up is still received.
    """

    def __init__(self, sock: socket.socket, key: bytes, side: bytes, info: dict[str, Any]) -> None:
        self.info = info
        """The follower's ``node_rank``, ``host`` and ``pid`` as it sent them, plus ``address``
        (the remote end, ``host:port``); on the follower side the leader's ``address`` and
        ``local``, the address this end reached it from."""
        self.last_heard = time.monotonic()
        """``time.monotonic()`` of the last frame received (of the handshake at first)."""
        self.close_reason = ""
        self._sock = sock
        self._key = key
        self._out = side
        self._in = FOLLOWER if side == LEADER else LEADER
        self._send_seq = 0
        self._recv_seq = 0
        self._send_lock = threading.Lock()
        self._send_failed = False
        self._closed = threading.Event()
        self._inbox: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
        self._reader = threading.Thread(target=self._read_loop, daemon=True,
                                        name=f"babysit-wire-{info.get('address', '?')}")

    def _start(self) -> Peer:
        self._sock.settimeout(SEND_TIMEOUT_S)
        self._ack_at_once()
        self._reader.start()
        return self

    @property
    def closed(self) -> bool:
        """True once the connection is gone; a closed peer never reopens."""
        return self._closed.is_set()

    def send(self, message: dict[str, Any]) -> bool:
        """Send one JSON object. Returns False (and never raises) once the connection is gone.

        Raises ``TypeError``/``ValueError`` only for a caller's mistake: a message that is not a
        JSON-serialisable dict, or one larger than ``MAX_FRAME`` once encoded.
        """
        if not isinstance(message, dict):
            raise TypeError(f"send() takes a dict, not {type(message).__name__}")
        body = json.dumps(message, separators=(",", ":")).encode()
        if len(body) > MAX_FRAME:
            raise ValueError(f"message of {len(body)} bytes exceeds MAX_FRAME ({MAX_FRAME})")
        with self._send_lock:
            if self.closed or self._send_failed:
                return False
            tag = _mac(self._key, self._out, _SEQUENCE.pack(self._send_seq), body)
            try:
                self._sock.sendall(_LENGTH.pack(len(body)) + tag + body)
            except TimeoutError:
                # The other side stopped reading: it is as good as gone.
                self._shutdown("error")
                return False
            except OSError:
                # A partial frame cannot be taken back: nothing more goes out. But the other
                # side hung up after its last words (a leader's "finish", then a close that
                # resets the connection): the reader still delivers every frame that arrived
                # before the hang-up, and marks the peer closed at its end.
                self._send_failed = True
                self.close_reason = self.close_reason or "error"
                with contextlib.suppress(OSError):
                    self._sock.shutdown(socket.SHUT_WR)
                return False
            self._send_seq += 1
            return True

    def receive(self) -> list[dict[str, Any]]:
        """Every message that arrived since the last call, in order; never blocks."""
        messages: list[dict[str, Any]] = []
        while True:
            try:
                messages.append(self._inbox.get_nowait())
            except queue.Empty:
                return messages

    def rtt(self) -> float | None:
        """The connection's round trip in seconds, as the kernel measures it on what the
        connection carries (TCP's smoothed RTT): the network path to the other end, with no
        message of ours. None off Linux, or once the socket is gone."""
        if _TCP_INFO is None or self.closed:
            return None
        try:
            info = self._sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, 104)
        except OSError:
            return None
        if len(info) < _TCPI_RTT + 4:
            return None
        (micros,) = struct.unpack_from("=I", info, _TCPI_RTT)
        return micros / 1e6 if micros else None

    def _ack_at_once(self) -> None:
        """Acknowledge what arrives at once, not with the next message out (up to a step
        later) or the delayed-ACK timer (40 ms): the other end's ``rtt`` is then the network's,
        not our traffic's. The kernel leaves quick-ACK mode by itself, so it is set again
        after every frame."""
        if _QUICKACK is not None:
            with contextlib.suppress(OSError):
                self._sock.setsockopt(socket.IPPROTO_TCP, _QUICKACK, 1)

    def keep_alive(self, every_s: float, beat: dict[str, Any]) -> None:
        """Send ``beat`` (a heartbeat message, ``messages.encode(Beat())``) every ``every_s``
        seconds from a daemon thread until the connection closes. The other side's silence
        timer then measures whether this process lives, not how long its loop is busy
        (checksumming a checkpoint, stopping workers, dumping stacks)."""
        def send_beats() -> None:
            while not self._closed.wait(every_s) and self.send(beat):
                pass

        threading.Thread(target=send_beats, daemon=True, name="babysit-beat").start()

    def close(self) -> None:
        """Close the connection; idempotent. Messages already received stay in ``receive``."""
        self._shutdown("closed")
        if self._reader.is_alive() and self._reader is not threading.current_thread():
            self._reader.join(timeout=1.0)

    def _shutdown(self, reason: str) -> None:
        if not self._closed.is_set():
            self.close_reason = self.close_reason or reason
            self._closed.set()
        with contextlib.suppress(OSError):
            # Wakes the reader (and a blocked sendall); the reader closes the descriptor.
            self._sock.shutdown(socket.SHUT_RDWR)
        if not self._reader.is_alive():
            self._sock.close()

    def _read_loop(self) -> None:
        reason = "error"
        try:
            reason = self._read_frames()
        except Exception:  # a bad peer must never crash the process
            reason = "error"
        finally:
            self._shutdown(reason)
            with self._send_lock:
                self._sock.close()

    def _read_frames(self) -> str:
        header_size = _LENGTH.size + TAG_BYTES
        while not self.closed:
            header = _recv_exact(self._sock, header_size, None)
            if header is None:
                return "eof"
            (length,) = _LENGTH.unpack_from(header)
            if length > MAX_FRAME:
                return "too_big"
            body = _recv_exact(self._sock, length, None)
            if body is None:
                return "eof"
            expected = _mac(self._key, self._in, _SEQUENCE.pack(self._recv_seq), body)
            if not hmac.compare_digest(expected, header[_LENGTH.size:]):
                return "tag"
            try:
                message = json.loads(body)
            except (UnicodeDecodeError, ValueError):
                return "json"
            if not isinstance(message, dict):
                return "not_object"
            self._recv_seq += 1
            self.last_heard = time.monotonic()
            self._inbox.put(message)
            self._ack_at_once()
        return "closed"


class Listener:
    """The leader's end: accepts followers that prove they know the run's secret.

    ``open()`` binds and starts a daemon accept thread; every connection is handshaken on its own
    thread under ``handshake_timeout_s``, so a silent or slow client never delays the others.
    Poll ``accept()`` for new peers. Refusals are counted in ``rejected`` by reason (``mac``,
    ``timeout``, ``malformed``, ``too_big``, ``eof``, ``busy``, ``error``); ``last_rejected``
    says which address and why, for the journal.
    """

    def __init__(self, host: str, port: int, secret: bytes, *,
                 handshake_timeout_s: float = 5.0) -> None:
        if not secret:
            raise ValueError("the run secret is empty; pass the run's shared secret bytes "
                             "(e.g. secrets.token_bytes(32), distributed to every node)")
        self.host = host
        self.handshake_timeout_s = handshake_timeout_s
        self.rejected: collections.Counter[str] = collections.Counter()
        self.last_rejected = ""
        self._port = port
        self._secret = secret
        self._server: socket.socket | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._pending: set[socket.socket] = set()
        self._new: list[Peer] = []
        self._peers: list[Peer] = []
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The bound port once open (the real one when constructed with port 0)."""
        return self._port

    @property
    def address(self) -> str:
        """``host:port`` that followers pass to ``connect``."""
        return format_address(self.host, self.port)

    def open(self) -> Listener:
        """Bind (with SO_REUSEADDR) and start accepting; returns self."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        self._server = socket.create_server((self.host, self._port), family=family)
        self._port = int(self._server.getsockname()[1])
        self._server.settimeout(_ACCEPT_POLL_S)
        self._thread = threading.Thread(target=self._accept_loop, daemon=True,
                                        name=f"babysit-listener-{self.address}")
        self._thread.start()
        return self

    def accept(self) -> list[Peer]:
        """Peers authenticated since the last call; never blocks."""
        with self._lock:
            new, self._new = self._new, []
            self._peers = [p for p in self._peers if not p.closed]
        return new

    def close(self) -> None:
        """Stop accepting, abort handshakes in progress and close every peer; idempotent."""
        self._stop.set()
        if self._server is not None:
            with contextlib.suppress(OSError):
                self._server.shutdown(socket.SHUT_RDWR)  # wakes accept() at once on Linux
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * _ACCEPT_POLL_S + 1.0)
        if self._server is not None:
            self._server.close()
        with self._lock:
            pending, peers = list(self._pending), self._peers + self._new
            self._new, self._peers = [], []
        for sock in pending:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for peer in peers:
            peer.close()

    def __enter__(self) -> Listener:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept_loop(self) -> None:
        assert self._server is not None
        while not self._stop.is_set():
            try:
                sock, addr = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                time.sleep(_ACCEPT_POLL_S)  # e.g. out of descriptors: back off, do not spin
                continue
            remote = format_address(str(addr[0]), int(addr[1]))
            with self._lock:
                busy = len(self._pending) >= MAX_PENDING
                if not busy:
                    self._pending.add(sock)
            if busy:
                sock.close()
                self._reject(remote, "busy", f"{MAX_PENDING} handshakes already in progress")
                continue
            threading.Thread(target=self._handshake, args=(sock, remote), daemon=True,
                             name=f"babysit-handshake-{remote}").start()

    def _reject(self, remote: str, reason: str, detail: str) -> None:
        with self._lock:
            self.rejected[reason] += 1
            self.last_rejected = f"{remote}: {reason} ({detail})"

    def _handshake(self, sock: socket.socket, remote: str) -> None:
        peer = None
        try:
            peer = self._authenticate(sock, remote)
        except _Refused as e:
            self._reject(remote, e.reason, str(e))
        except TimeoutError:
            self._reject(remote, "timeout",
                         f"no complete join within {self.handshake_timeout_s:g} s")
        except Exception as e:  # one bad client must not kill the listener
            self._reject(remote, "error", f"{type(e).__name__}: {e}")
        with self._lock:
            self._pending.discard(sock)
            if peer is not None and not self._stop.is_set():
                self._new.append(peer._start())
                self._peers.append(peer)
                return
        if peer is not None:
            peer.close()
        sock.close()

    def _authenticate(self, sock: socket.socket, remote: str) -> Peer:
        deadline = time.monotonic() + self.handshake_timeout_s
        server_nonce = secrets.token_bytes(NONCE_BYTES)
        _send_plain(sock, {"babysit": VERSION, "nonce": server_nonce.hex()}, deadline)
        join = _recv_plain(sock, deadline)
        if join is None:
            raise _Refused("eof", "closed the connection during the handshake")
        client_nonce = _nonce(join)
        mac = _nonce(join, "mac")  # also 32 bytes of hex
        node_rank, host, pid = (join.get(k) for k in _NODE_FIELDS)
        if (client_nonce is None or mac is None or set(join) != {*_NODE_FIELDS, "nonce", "mac"}
                or not isinstance(node_rank, int) or isinstance(node_rank, bool) or node_rank < 0
                or not isinstance(host, str)
                or not isinstance(pid, int) or isinstance(pid, bool)):
            raise _Refused("malformed", f"join message has unexpected fields: {sorted(join)}")
        expected = _mac(self._secret, b"join|", server_nonce, client_nonce, _canonical(join))
        if not hmac.compare_digest(expected, mac):
            raise _Refused("mac", f"node {node_rank} on {host!r} does not know the run secret")
        welcome = _mac(self._secret, b"welcome|", client_nonce, server_nonce)
        _send_plain(sock, {"mac": welcome.hex()}, deadline)
        key = _mac(self._secret, b"session|", server_nonce, client_nonce)
        info = {"node_rank": node_rank, "host": host, "pid": pid, "address": remote}
        return Peer(sock, key, LEADER, info)


def connect(address: str, secret: bytes, node: dict[str, Any], timeout_s: float = 10.0) -> Peer:
    """Join the leader at ``address`` (``host:port`` or ``[v6]:port``) as a follower.

    ``node`` carries ``node_rank`` (required), ``host`` and ``pid`` (default: this machine and
    process). ``timeout_s`` bounds the connection and the whole handshake. Raises ``AuthError``
    when the leader refuses us or cannot prove it knows the secret, ``OSError`` when nobody
    listens or the network fails. Does not retry: that is the caller's job.
    """
    if not secret:
        raise ValueError("the run secret is empty; pass the run's shared secret bytes")
    unknown = set(node) - set(_NODE_FIELDS)
    if "node_rank" not in node or unknown:
        raise ValueError(f"node must hold node_rank (and optionally host, pid); got {sorted(node)}")
    fields = {"node_rank": node["node_rank"], "host": node.get("host", socket.gethostname()),
              "pid": node.get("pid", os.getpid())}
    host, port = parse_address(address)
    deadline = time.monotonic() + timeout_s
    sock = socket.create_connection((host, port), timeout=timeout_s)
    try:
        key = _join(sock, address, secret, fields, deadline)
    except BaseException:
        sock.close()
        raise
    return Peer(sock, key, FOLLOWER, {"address": address,
                                      "local": sock.getsockname()[0]})._start()


def _join(sock: socket.socket, address: str, secret: bytes, fields: dict[str, Any],
          deadline: float) -> bytes:
    """The follower's half of the handshake; returns the session key."""
    try:
        hello = _recv_plain(sock, deadline)
    except _Refused as e:
        raise AuthError(f"{address} is not a babysit leader: {e}") from None
    server_nonce = None if hello is None else _nonce(hello)
    if hello is None or hello.get("babysit") != VERSION or server_nonce is None:
        raise AuthError(f"{address} is not a babysit leader of this version (it sent {hello!r}); "
                        "check the address and that every node runs the same babysit version")
    client_nonce = secrets.token_bytes(NONCE_BYTES)
    mac = _mac(secret, b"join|", server_nonce, client_nonce, _canonical(fields))
    _send_plain(sock, {**fields, "nonce": client_nonce.hex(), "mac": mac.hex()}, deadline)
    try:
        welcome = _recv_plain(sock, deadline)
    except _Refused as e:
        raise AuthError(f"the leader at {address} sent a bad welcome: {e}") from None
    if welcome is None:
        raise AuthError(f"the leader at {address} refused this node during the handshake: the "
                        "run secret probably differs between the nodes; give every node the "
                        "same secret")
    expected = _mac(secret, b"welcome|", client_nonce, server_nonce)
    got = _nonce(welcome, "mac")
    if got is None or not hmac.compare_digest(expected, got):
        raise AuthError(f"the leader at {address} could not prove it knows the run secret: it is "
                        "not this run's leader, or the secrets differ; not taking its commands")
    return _mac(secret, b"session|", server_nonce, client_nonce)
