"""torchrun started ahead: the next attempt's launcher, its interpreter up and torch imported,
waiting for its command line.

A cold relaunch starts a new torchrun: an interpreter and ``import torch.distributed.run``,
about 1.1-1.4 s of the 3.6-3.8 s from relaunch to first step on this 2-core machine
(docs/recovery.md), before it even starts the ranks. None of that depends on the attempt: its
command line (the rendezvous, this node's place, the world) and environment do. So when no warm
standby can serve a run (``launch.warm_standby: false``, a multi-node run, a fixed rendezvous
endpoint: ``standby.off_reason``), babysit starts the next attempt's torchrun ahead, once
the running attempt made a step: ``python -m babysit.supervisor.node.ahead`` imports torch's
launcher and reads one line on its standard input. The relaunch writes the attempt's order
there (``Order``: torchrun's arguments, the environment, the folder) and the process becomes
that torchrun, exactly as if started then. It never touches a GPU (torchrun's agent does not),
holds no rank and reads nothing of the run; it costs one interpreter with torch imported (about
0.3 GB resident) and its start-up (``import_launcher``; both measured in
docs/measured.md#standby-cost). A closed standard input (babysit gone, or the process dropped)
ends it. ``launch.torchrun_ahead: false`` turns it off.

The first attempt's torchrun is started ahead too, whatever serves the relaunches: by
``babysit run`` itself, first thing (``Early``), before babysit imports its own modules, reads
the config and opens its services, so that its start-up and torchrun's overlap (about 0.5 s
of babysit's own against 1-2 s of torchrun's on this 2-core machine). Its environment is
babysit's own, not yet the attempt's (the order brings that), so the first launch takes it
only where that makes no difference (``Early.unfit``); otherwise, or where it is off, it is
stopped and the launch is cold as before.

Pure but for ``main`` (the process itself) and ``Early``: the order's encoding, and when one
fits an attempt.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from babysit.supervisor.node import shield

MODULE = "babysit.supervisor.node.ahead"
TORCHRUN = ["-m", "torch.distributed.run"]
"""What follows the interpreter in every torchrun command line babysit builds."""


@dataclass(frozen=True, slots=True)
class Order:
    """What makes a torchrun started ahead the attempt's: one JSON line on its stdin."""

    argv: list[str]
    """torchrun's arguments (the command line after ``python -m torch.distributed.run``)."""
    env: dict[str, str]
    cwd: str
    hold: str | None = None
    """The rendezvous endpoint (``host:port``) whose c10d store this torchrun hosts
    (``hosted_store``): held open once torchrun is done, until babysit closes the standard
    input, since the other nodes' torchruns use it to the end of their exit barrier and
    rendezvous shutdown (``main``)."""

    def encode(self) -> bytes:
        fields: dict[str, Any] = {"argv": self.argv, "env": self.env, "cwd": self.cwd}
        if self.hold is not None:
            fields["hold"] = self.hold
        return (json.dumps(fields) + "\n").encode()

    @classmethod
    def decode(cls, line: bytes | str) -> Order:
        data: dict[str, Any] = json.loads(line)
        hold = data.get("hold")
        return cls([str(a) for a in data["argv"]], {str(k): str(v) for k, v in data["env"].items()},
                   str(data["cwd"]), str(hold) if hold is not None else None)

    @classmethod
    def of(cls, command: list[str], env: dict[str, str], cwd: str) -> Order | None:
        """The order for torchrun ``command`` (``launcher.torchrun_command``), or None when it
        is not one an ahead process can run (another interpreter was asked for)."""
        if len(command) < 3 or command[1:3] != TORCHRUN:
            return None
        return cls(command[3:], env, cwd, hosted_store(command[3:]))


def hosted_store(argv: list[str]) -> str | None:
    """The endpoint of the c10d rendezvous store torchrun's arguments ``argv`` say it hosts
    (``is_host=1`` in ``--rdzv-conf``: the leader's node, ``launcher.Placement``), or None."""
    def value(flag: str) -> str | None:
        return argv[argv.index(flag) + 1] if flag in argv[:-1] else None

    hosts = "is_host=1" in (value("--rdzv-conf") or "").split(",")
    return value("--rdzv-endpoint") if hosts and value("--rdzv-backend") == "c10d" else None


def command(python: str) -> list[str]:
    """The command line of a torchrun started ahead with interpreter ``python``."""
    return [python, "-m", MODULE]


INTERPRETER_ENV = ("PYTHON", "LD_")
"""Prefixes of the variables an interpreter reads as it starts (which modules, which native
libraries): set by ``launch.env``, they must be there before ``import torch``, so a torchrun
started with babysit's own environment cannot take the order."""


class Early:
    """The first attempt's torchrun, started ahead by ``babysit run`` before anything else
    (see the module docstring). ``take`` hands its process to the first launch, once;
    ``stop`` ends it when nobody took it (idempotent)."""

    def __init__(self, python: str = sys.executable) -> None:
        self.python = python
        self.env = {**os.environ}
        self.env.setdefault("PYTHONUNBUFFERED", "1")  # as every attempt's (NodeWorkers._env)
        self._proc: subprocess.Popen[bytes] | None = subprocess.Popen(
            command(python), env=self.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=shield.preexec())

    def unfit(self, python: str, launch_env: Mapping[str, str], on: bool,
              command_: list[str]) -> str | None:
        """Why the launch of ``command_`` (with ``python``, the config's ``launch.env`` and
        ``launch.torchrun_ahead`` as ``on``) cannot take this process, or None. Pure."""
        if not on:
            return "launch.torchrun_ahead is false"
        if python != self.python:
            return f"the run's interpreter is {python}, not {self.python}"
        if Order.of(command_, {}, "") is None:
            return "the launch is not torchrun's"
        read = sorted(k for k in launch_env if k.startswith(INTERPRETER_ENV)
                      and launch_env[k] != self.env.get(k))
        if read:
            return f"launch.env sets {', '.join(read)}, read as the interpreter starts"
        return None

    def take(self) -> subprocess.Popen[bytes] | None:
        """The process, still running, for the first launch to feed; None after the first
        call, or when it ended on its own."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is not None:
            return None
        return proc

    def stop(self) -> None:
        """End the process if nobody took it: it has imported torch and holds nothing."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()


def import_launcher() -> ModuleType:
    """``torch.distributed.run``, imported with Python's collector paused: the import makes
    about a million objects and no garbage, and collecting over them as they come is a good
    part of its CPU (``benchmarks/ahead_start.py``, docs/measured.md#standby-cost). What it
    built is then set aside from the agent's collections to come (``gc.freeze``); the
    collector runs again as ever."""
    gc.disable()
    try:
        from torch.distributed import run
    finally:
        gc.freeze()
        gc.enable()
    return run


def main() -> None:
    run = import_launcher()  # the slow part, done ahead of the relaunch
    line = sys.stdin.buffer.readline()
    if not line.strip():
        return  # dropped: babysit closed our stdin
    order = Order.decode(line)
    os.environ.clear()
    os.environ.update(order.env)
    os.chdir(order.cwd)
    sys.argv = ["torch.distributed.run", *order.argv]
    held = _hold(order.hold) if order.hold is not None else None
    run.main(order.argv)
    if held is not None:
        # torchrun's agent is done with the store, its exit barrier passed; the other nodes'
        # agents still use it to shut the rendezvous down, and would fail to (a warning and a
        # stack on each) if it went with this process. babysit says when they are all gone.
        with contextlib.suppress(Exception):  # a stop's SIGTERM: torchrun's handler raises
            sys.stdin.buffer.read()


def _hold(endpoint: str) -> Any:
    """A server of the c10d store at ``endpoint`` in this process, which torchrun's agent then
    shares (the rendezvous opens it multi-tenant: one server per port and process) and which
    outlives the agent; None when it cannot be opened (torchrun then opens its own, as ever)."""
    # Public, but re-exported without __all__: mypy cannot see it.
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    from babysit.supervisor.config.address import parse_address

    try:
        host, port = parse_address(endpoint)
        return TCPStore(host, port, is_master=True, multi_tenant=True, wait_for_workers=False)
    except (RuntimeError, ValueError):
        return None


if __name__ == "__main__":
    main()
