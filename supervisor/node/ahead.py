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
0.3 GB resident) and its start-up, about 1.7 CPU-seconds. A closed standard input (babysit gone,
or the process dropped) ends it. ``launch.torchrun_ahead: false`` turns it off.

Pure but for ``main`` (the process itself): the order's encoding, and when one fits an attempt.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from typing import Any

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

    def encode(self) -> bytes:
        return (json.dumps({"argv": self.argv, "env": self.env, "cwd": self.cwd}) + "\n").encode()

    @classmethod
    def decode(cls, line: bytes | str) -> Order:
        data: dict[str, Any] = json.loads(line)
        return cls([str(a) for a in data["argv"]], {str(k): str(v) for k, v in data["env"].items()},
                   str(data["cwd"]))

    @classmethod
    def of(cls, command: list[str], env: dict[str, str], cwd: str) -> Order | None:
        """The order for torchrun ``command`` (``launcher.torchrun_command``), or None when it
        is not one an ahead process can run (another interpreter was asked for)."""
        if len(command) < 3 or command[1:3] != TORCHRUN:
            return None
        return cls(command[3:], env, cwd)


def command(python: str) -> list[str]:
    """The command line of a torchrun started ahead with interpreter ``python``."""
    return [python, "-m", MODULE]


def main() -> None:
    from torch.distributed import run  # the slow part, done ahead of the relaunch

    line = sys.stdin.buffer.readline()
    if not line.strip():
        return  # dropped: babysit closed our stdin
    order = Order.decode(line)
    os.environ.clear()
    os.environ.update(order.env)
    os.chdir(order.cwd)
    sys.argv = ["torch.distributed.run", *order.argv]
    run.main(order.argv)


if __name__ == "__main__":
    main()
