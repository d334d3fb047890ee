"""Starting and stopping one attempt: a fresh ``python -m torch.distributed.run`` child.

babysit owns restarts. torchrun's in-agent restart fails to reconnect gloo workers in torch 2.13
(unless ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``), so every attempt is a new torchrun with
``--max-restarts 0`` and a fresh rendezvous port, started in its own session.

torchrun starts each worker in a session of its own too, so signalling the launcher's process
group does not reach them, and a worker whose launcher died is re-parented away from it. babysit
therefore marks itself a *child subreaper* (Linux): every orphan of the tree is re-parented to
babysit, and babysit's children that carry the attempt's environment, with torchrun's tree, are
every process to stop (babysit's own helpers, such as wandb's service, are left alone).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from babysit.supervisor.config.address import parse_address
from babysit.supervisor.config.schema import LaunchConfig
from babysit.supervisor.contract.protocol import ENV_ATTEMPT, ENV_RUN_DIR
from babysit.supervisor.node import shield

_PR_SET_CHILD_SUBREAPER = 36


def rank_prefix(role: str | None = None) -> re.Pattern[str]:
    """torchrun's tee prefix of a worker's output, ``[default0]:`` (``[<role><local rank>]:``
    with ``--role``)."""
    return re.compile(rf"\[{re.escape(role or 'default')}(\d+)\]:")


def split_rank(text: str, prefix: re.Pattern[str]) -> OutputLine:
    """One tee'd line as (text, local rank). torchrun prefixes every *read* of a rank's log, so a
    progress bar redrawn with carriage returns, read in pieces, carries the prefix again inside
    the line: every copy goes, not only the first."""
    match = prefix.match(text)
    if match is None:
        return OutputLine(text, None)
    return OutputLine(prefix.sub("", text[match.end():]), int(match.group(1)))


def become_subreaper() -> bool:
    """Adopt orphaned descendants (Linux only). Returns False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def newest_state(text: str) -> str:
    """What a terminal would show of a line redrawn with carriage returns: its last state."""
    if "\r" not in text:
        return text
    parts = [p for p in text.split("\r") if p.strip()]
    return parts[-1] if parts else ""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now, for a fresh rendezvous endpoint per attempt."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True, slots=True)
class Placement:
    """Where this node stands in a multi-node attempt, for torchrun and gloo.

    A machine whose host name resolves to an address the other nodes cannot reach (127.0.0.1
    on many multi-homed hosts and containers) leaves torchrun unsure which node hosts the c10d
    store, and gives the workers a ``MASTER_ADDR`` and gloo an interface nobody else can
    reach. babysit knows better: the leader's node hosts the rendezvous, and each node is
    reached at the address it reached the leader from. What the user set wins.
    """

    rdzv_host: bool | None
    """This node hosts the c10d rendezvous store (``is_host`` in ``--rdzv-conf``); None: say
    nothing (the endpoint is not one babysit can vouch for)."""
    local_addr: str | None
    """The address the other nodes reach this node at (``--local-addr``)."""

    @classmethod
    def in_attempt(cls, endpoint: str, leader_host: str, *, leads: bool,
                   local_addr: str | None) -> Placement:
        """The placement of a node that ``leads`` the attempt or follows it: whether it hosts
        the store is said only when ``endpoint`` is on the leader's host (always, when babysit
        picked it)."""
        on_leader = parse_address(endpoint)[0] == leader_host
        return cls(rdzv_host=leads if on_leader else None, local_addr=local_addr)

    def apply(self, launch: LaunchConfig, env: dict[str, str]
              ) -> tuple[LaunchConfig, dict[str, str]]:
        """The attempt's launch settings and the environment it adds, with what is unset filled
        in; ``env`` is the environment the workers would get."""
        update: dict[str, object] = {}
        conf = launch.rdzv_conf or ""
        if self.rdzv_host is not None and launch.rendezvous == "c10d" and \
                "is_host" not in conf:
            update["rdzv_conf"] = ",".join(filter(None, [conf, f"is_host={int(self.rdzv_host)}"]))
        extra: dict[str, str] = {}
        if self.local_addr:
            if launch.local_addr is None:
                update["local_addr"] = self.local_addr
            interface = interface_of(self.local_addr)
            if interface is not None and "GLOO_SOCKET_IFNAME" not in env:
                extra["GLOO_SOCKET_IFNAME"] = interface
        return (launch.model_copy(update=update) if update else launch), extra


def route_source(host: str, port: int) -> str | None:
    """The address this machine sends from to reach ``host`` (no packet is sent: a UDP
    socket's connect only asks the routing table), or None without a route."""
    try:
        family, kind, proto, _, target = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.connect(target)
            return str(probe.getsockname()[0])
    except OSError:
        return None


def interface_of(address: str) -> str | None:
    """The network interface holding ``address`` (an IP, or a name resolved here), or None."""
    try:
        ips = {info[4][0] for info in socket.getaddrinfo(address, None)}
    except OSError:
        return None
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] in ips for a in addrs):
            return name
    return None


PREWARM = "babysit.supervisor.rank.prewarm"
"""The module an import standby's ranks run before the script (``rank/prewarm.py``)."""


def torchrun_command(
    launch: LaunchConfig,
    script: Path | None,
    *,
    python: str,
    rdzv_id: str,
    rdzv_endpoint: str,
    log_dir: Path,
    prewarm: bool = False,
    shielded: bool = False,
) -> list[str]:
    """The torchrun command line for one attempt. Pure: builds a list, starts nothing.
    ``prewarm``: the ranks run ``rank.prewarm`` with the script and its arguments (an import
    standby's). ``shielded``: torchrun leaves SIGTERM alone (``node.shield``)."""
    cmd = [python, "-m", "torch.distributed.run",
           "--nproc-per-node", str(launch.nproc_per_node),
           "--nnodes", launch.nnodes,
           # Read by the static rendezvous only; any other warns that it ignores it.
           *(["--node-rank", str(launch.node_rank)] if launch.rendezvous == "static" else []),
           "--max-restarts", "0",
           "--rdzv-backend", launch.rendezvous,
           "--rdzv-endpoint", rdzv_endpoint,
           "--rdzv-id", rdzv_id,
           # Per-rank stdout/stderr files under the attempt folder, and tee'd to the console.
           "--log-dir", str(log_dir), "--redirects", "3", "--tee", "3"]
    optional: list[tuple[str, object]] = [
        ("--rdzv-conf", launch.rdzv_conf), ("--master-addr", launch.master_addr),
        ("--master-port", launch.master_port), ("--local-addr", launch.local_addr),
        ("--start-method", launch.start_method), ("--monitor-interval", launch.monitor_interval),
        ("--role", launch.role),
    ]
    for flag, value in optional:
        if value is not None:
            cmd += [flag, str(value)]
    if launch.no_python:
        cmd.append("--no-python")
    cmd += launch.torchrun_args
    if shielded:
        cmd += shield.torchrun_args(launch.torchrun_args)
    if prewarm:
        cmd += ["-m", PREWARM]
        cmd += ["-m", launch.module] if launch.module is not None else [str(script)]
    elif launch.module is not None:
        cmd += ["-m", launch.module]
    else:
        cmd.append(str(script))
    return cmd + launch.args


@dataclass(frozen=True, slots=True)
class OutputLine:
    """A line the workers or torchrun printed; ``rank`` is set for tee'd worker output."""

    text: str
    rank: int | None


class WorkerGroup:
    """One attempt's torchrun and everything it starts.

    ``start()`` launches; ``poll()`` returns torchrun's exit code once it ended; ``stop()`` ends
    every process of the tree, politely first. Output lines are written to ``log_path`` and
    queued on ``lines`` for the console; when the console falls behind, queued lines are dropped
    (the log file keeps them all). ``env`` carries the attempt's ``BABYSIT_RUN_DIR`` and
    ``BABYSIT_ATTEMPT``: they tell its orphans from babysit's own helpers.
    """

    def __init__(self, command: list[str], env: dict[str, str], cwd: Path, log_path: Path,
                 lines: queue.Queue[OutputLine], role: str | None = None,
                 siblings: set[int] | None = None, fed: bool = False) -> None:
        """``siblings``: the launcher pids of this node's other live groups (a warm standby
        beside the running attempt), shared and kept current by the caller: babysit's children
        too, but never this group's to reap (their own ``Popen`` must see their exit).
        ``fed``: its standard input is a pipe, for ``feed`` (a torchrun started ahead)."""
        self.command = command
        self.siblings = siblings if siblings is not None else set()
        self._lines_lock = threading.Lock()
        self._prefix = rank_prefix(role)
        self._env = env
        self._cwd = cwd
        self.log_path = log_path
        self._lines = lines
        self._proc: subprocess.Popen[bytes] | None = None
        self._reader: threading.Thread | None = None
        self._known: dict[int, psutil.Process] = {}
        self._fed = fed
        self.dropped_lines = 0

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def start(self, started: subprocess.Popen[bytes] | None = None) -> None:
        """Launch ``command``; or, given ``started`` (a process already running ``command``
        with ``env``, its standard input and output pipes, in a session of its own: an
        ``ahead.Early``), take it over."""
        self._proc = started or subprocess.Popen(
            self.command, env=self._env, cwd=self._cwd,
            stdin=subprocess.PIPE if self._fed else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=shield.preexec(),
        )
        self._reader = threading.Thread(target=self._pump, name="babysit-output", daemon=True)
        self._reader.start()

    def _pump(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        with open(self.log_path, "ab") as log:
            for raw in iter(self._proc.stdout.readline, b""):
                log.write(raw)
                log.flush()
                line = split_rank(raw.decode("utf-8", "replace").rstrip("\n"), self._prefix)
                with self._lines_lock:
                    try:
                        self._lines.put_nowait(line)
                    except queue.Full:
                        self.dropped_lines += 1

    def feed(self, data: bytes, command: list[str], env: dict[str, str],
             keep_open: bool = False) -> bool:
        """Write ``data`` to the process's standard input and close it (``keep_open``: not
        until ``release``); from now on the group is ``command`` run with ``env`` (what it
        became: ``node.ahead``). False when the process is gone (nothing became of it)."""
        assert self._proc is not None and self._proc.stdin is not None
        try:
            self._proc.stdin.write(data)
            self._proc.stdin.flush()
            if not keep_open:
                self._proc.stdin.close()
        except (BrokenPipeError, ValueError):
            return False
        self.command, self._env = command, env
        return True

    def release(self) -> None:
        """Close the process's standard input, if still open: a torchrun started ahead that
        hosts the rendezvous store holds it until then (``ahead.Order.hold``)."""
        if self._proc is not None and self._proc.stdin is not None:
            with contextlib.suppress(OSError, ValueError):
                self._proc.stdin.close()

    def redirect(self, lines: queue.Queue[OutputLine]) -> None:
        """Send output to ``lines`` from now on, after what was queued so far (a standby's
        start-up output reaches the console once it is the running attempt)."""
        with self._lines_lock:
            while True:
                try:
                    line = self._lines.get_nowait()
                except queue.Empty:
                    break
                try:
                    lines.put_nowait(line)
                except queue.Full:
                    self.dropped_lines += 1
            self._lines = lines

    def poll(self) -> int | None:
        """torchrun's exit code (negative for a signal), or None while it runs."""
        if self._proc is None:
            return None
        code = self._proc.poll()
        if code is not None and self._reader is not None:
            self._reader.join(timeout=2.0)  # let the last lines reach the log and console
        return code

    def processes(self) -> list[psutil.Process]:
        """Every live process of this attempt: torchrun, the workers and what they started."""
        self._refresh()
        return list(self._known.values())

    def _refresh(self) -> None:
        roots = []
        if self._proc is not None:
            with contextlib.suppress(psutil.NoSuchProcess):
                roots.append(psutil.Process(self._proc.pid))
        # Orphans re-parented to us (as subreaper) are our children now. So are babysit's own
        # helpers (wandb's service process, a py-spy dump), which no attempt may stop: an
        # orphan is known by the environment it inherited from this attempt's torchrun.
        with contextlib.suppress(psutil.NoSuchProcess):
            roots.extend(p for p in psutil.Process().children() if self._inherited_env(p))
        for proc in roots:
            with contextlib.suppress(psutil.NoSuchProcess):
                for p in [proc, *proc.children(recursive=True)]:
                    self._known.setdefault(p.pid, p)
        self._known = {pid: p for pid, p in self._known.items() if _alive(p)}

    def _inherited_env(self, proc: psutil.Process) -> bool:
        try:
            env = proc.environ()
        except psutil.Error:
            return False
        return all(env.get(key) == self._env.get(key) for key in (ENV_RUN_DIR, ENV_ATTEMPT))

    def stop(self, grace_s: float, launcher_grace_s: float | None = None) -> int | None:
        """SIGTERM every process group of the tree, wait up to ``grace_s``, then SIGKILL
        (SIGHUP for SIGTERM where the tree ignores it: ``node.shield``).

        ``launcher_grace_s``: once everything but torchrun is gone, how long torchrun may take
        to exit on its own before it is killed (None: the rest of ``grace_s``). Its own
        shutdown after the ranks died (stopping the agent, the rendezvous, its interpreter:
        about 0.5 s) matters when a person stops the run, not when babysit replaces an attempt
        whose ranks' logs are already on disk.

        Blocks until everything is gone. Returns torchrun's exit code.
        """
        self.release()
        self._signal_all(shield.stop_signal())
        # A stopped rank (SIGSTOP, a hang babysit found) handles SIGTERM only once continued.
        self._signal_all(signal.SIGCONT)
        deadline = time.monotonic() + grace_s
        alone_since: float | None = None
        while time.monotonic() < deadline:
            self._reap()
            left = self.processes()
            if not left:
                break
            if launcher_grace_s is not None and [p.pid for p in left] == [self.pid]:
                alone_since = alone_since or time.monotonic()
                if time.monotonic() - alone_since >= launcher_grace_s:
                    signal_groups(left, signal.SIGKILL)
            time.sleep(0.02)
        else:
            self._signal_all(signal.SIGKILL)
            for p in self.processes():
                with contextlib.suppress(psutil.Error):
                    p.wait(timeout=5)
        self._reap()
        code = self._proc.wait() if self._proc else None
        if self._reader is not None:
            self._reader.join(timeout=2.0)
        return code

    def pause(self, paused: bool) -> None:
        """Stop (SIGSTOP) or continue (SIGCONT) every process of the tree. ``stop`` continues a
        paused tree by itself.

        A process that torchrun (or a rank) started between the listing and the signal, in a
        session of its own, would miss it and go on importing torch beside the pause: the tree
        is listed again after each signal until nothing new is in it (once its parents are
        stopped they start nothing more)."""
        sig = signal.SIGSTOP if paused else signal.SIGCONT
        done: set[int] = set()
        for _ in range(5):
            new = [p for p in self.processes() if p.pid not in done]
            if not new:
                return
            signal_groups(new, sig)
            done.update(p.pid for p in new)

    def _signal_all(self, sig: signal.Signals) -> None:
        signal_groups(self.processes(), sig)

    def _reap(self) -> None:
        # Orphans adopted by us (subreaper) become our zombies; collect them, but never torchrun,
        # whose exit status Popen must see.
        launcher = self._proc.pid if self._proc is not None else None
        with contextlib.suppress(psutil.Error):
            for p in psutil.Process().children():
                if p.pid != launcher and p.pid not in self.siblings \
                        and p.status() == psutil.STATUS_ZOMBIE:
                    with contextlib.suppress(ChildProcessError, OSError):
                        os.waitpid(p.pid, os.WNOHANG)


def signal_groups(procs: list[psutil.Process], sig: signal.Signals) -> None:
    """Send ``sig`` to the process group of each of ``procs`` (torchrun starts every worker in
    a session of its own), never to babysit's own group, then to each process directly."""
    groups = set()
    for p in procs:
        with contextlib.suppress(psutil.Error, OSError):
            groups.add(os.getpgid(p.pid))
    for pgid in groups:
        if pgid != os.getpgrp():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, sig)
    for p in procs:  # processes that share babysit's group, if any
        with contextlib.suppress(psutil.Error):
            p.send_signal(sig)


def stop_leftovers(pids: tuple[int, ...], run_dir: Path, grace_s: float) -> list[int]:
    """Stop what a killed supervisor of ``run_dir`` left running; returns the pids stopped.

    Only processes whose environment names this run directory count (with their children):
    pids are reused, and a stranger's process must never be signalled. A torchrun whose own
    environment does not (the first attempt's, started before babysit read the config:
    ``ahead.Early``) counts by its children's.
    """
    ours: dict[int, psutil.Process] = {}
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            tree = [proc, *proc.children(recursive=True)]
            if any(_names(p, run_dir) for p in tree[:1] + proc.children()):
                for p in tree:
                    ours[p.pid] = p
    procs = [p for p in ours.values() if _alive(p)]
    if not procs:
        return []
    signal_groups(procs, shield.stop_signal())
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    if alive:
        signal_groups(alive, signal.SIGKILL)
        psutil.wait_procs(alive, timeout=5)
    return sorted(p.pid for p in procs)


def _names(proc: psutil.Process, run_dir: Path) -> bool:
    """``proc``'s environment names ``run_dir`` (it was started for one of its attempts)."""
    with contextlib.suppress(psutil.Error):
        return proc.environ().get(ENV_RUN_DIR) == str(run_dir)
    return False


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def rank_logs(attempt_dir: Path) -> dict[int, Path]:
    """Each local rank's stderr log of an attempt (torchrun's ``--log-dir`` layout)."""
    logs = {}
    for path in attempt_dir.glob("torchrun/*/attempt_*/*/stderr.log"):
        with contextlib.suppress(ValueError):
            logs[int(path.parent.name)] = path
    return logs


_ROOT_CAUSE = re.compile(r"Root Cause \(first observed failure\):.*?rank\s*:\s*(\d+)", re.S)


_FAILED_RANK = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)")


def failed_ranks(launcher_output: str) -> dict[int, int]:
    """Local rank -> global rank of every failure torchrun's end-of-run summary lists (a rank
    that died before saying hello is known to babysit by its log folder, a local rank)."""
    return {int(local): int(rank) for rank, local in _FAILED_RANK.findall(launcher_output)}


_RANK_EXIT = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


def rank_exits(launcher_output: str) -> dict[int, int]:
    """Global rank -> exit code of every failure torchrun's end-of-run summary lists (negative:
    killed by that signal, as ``subprocess`` reports it: -11 is SIGSEGV, -9 SIGKILL).

    This is the evidence of who failed and how; the ranks' log tails only explain it. Ranks
    torchrun stopped itself after the first failure are not listed."""
    return {int(rank): int(code) for rank, code in _RANK_EXIT.findall(launcher_output)}


_SUMMARY_END = re.compile(r"Root Cause \(first observed failure\):\n.*?\n=+[ \t]*\n", re.S)


def failure_summarized(launcher_output: str) -> bool:
    """torchrun has printed its whole end-of-run failure summary (the root cause and the rule
    of ``=`` under it). It does so only after stopping every rank; all that is left of it is
    its own interpreter's exit."""
    return _SUMMARY_END.search(launcher_output) is not None


def root_cause_rank(launcher_output: str) -> int | None:
    """The global rank torchrun names as the first failure, from its end-of-run summary.

    The other ranks usually die of the consequence (a peer closed the connection), so this is
    the rank whose log explains the crash.
    """
    match = _ROOT_CAUSE.search(launcher_output)
    return int(match.group(1)) if match else None


def tail(path: Path, max_bytes: int = 16384) -> str:
    """The end of a log file, decoded leniently (logs may hold partial UTF-8 at the cut)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""
