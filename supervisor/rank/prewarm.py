"""The import standby's entry point (``launch.warm_standby: imports``, the default on GPUs).

torchrun runs this module instead of the script in a standby's ranks::

    python -u -m babysit.supervisor.rank.prewarm train.py --lr 3e-4     # a script
    python -u -m babysit.supervisor.rank.prewarm -m pkg.train --lr 3e-4 # launch.module

Each rank imports torch, says it is ready and waits for ``go`` exactly as a full standby's
rank waits in ``attach()`` (``api._await_promotion``), and only then runs the script, as
``python train.py ...`` would (``sys.argv``, ``sys.path[0]``, ``__main__``). What a relaunch
through it skips: torchrun's start and rendezvous, the interpreter and ``import torch`` (7.3 s
of a 15 s cold relaunch on one H200, docs/gpu.md), and the modules DDP's constructor and the
restore import on first use (``WARM_MODULES``). What it does not: the script's own imports,
the model build, CUDA and NCCL initialisation and the checkpoint load.

Why not wait in ``attach()`` on a GPU: by then the script has made its CUDA context and
usually put its model on the device, beside the training attempt's (1.2 GB for two small ranks
on an H200, docs/gpu.md). ``import torch`` touches no GPU: a rank waiting here holds host memory
only, and no CUDA context.
"""

from __future__ import annotations

import importlib
import os
import runpy
import sys
from pathlib import Path

from babysit.supervisor.contract import protocol

MODULE = __name__
"""What torchrun is told to run (``-m``) in an import standby's ranks."""


WARM_MODULES = ("torch.distributed", "torch._dynamo", "torch.distributed.checkpoint")
"""What a waiting rank imports: torch, then what every relaunch imports next unless it is
here already. ``torch._dynamo``: DDP's constructor (and ``torch.compile``) imports it, 1.1 s of
CPU and about 70 MB a rank on this 2-core machine; ``torch.distributed.checkpoint``: the
restore loads with it. None of them makes a CUDA context."""


def warm_imports() -> None:
    """Import ``WARM_MODULES``, passing over any that fails (a torch built without one: the
    script will import what it needs itself, as a cold start would)."""
    for name in WARM_MODULES:
        try:
            importlib.import_module(name)
        except Exception:  # a partial build; never a reason not to stand by
            continue


def main(argv: list[str]) -> None:
    # The bulk of a rank's start-up; none of it makes a CUDA context.
    warm_imports()

    from babysit.supervisor.rank import api

    folder = os.environ.pop(protocol.ENV_STANDBY, None)  # attach() must not wait a second time
    if folder:
        api._await_promotion(Path(folder), int(os.environ.get("WORLD_SIZE", "1")),
                             int(os.environ.get(protocol.ENV_SUPERVISOR_PID, "0")))
    if argv[:1] == ["-m"] and len(argv) > 1:
        sys.argv = [argv[1], *argv[2:]]  # sys.path[0] is the working directory, as for -m
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv:
        script = os.path.abspath(argv[0])
        sys.argv = [argv[0], *argv[1:]]
        sys.path[0] = os.path.dirname(script)  # as ``python script.py`` has it
        runpy.run_path(script, run_name="__main__")
    else:
        raise SystemExit(f"usage: python -m {MODULE} SCRIPT [ARGS] | -m MODULE [ARGS]")


if __name__ == "__main__":
    main(sys.argv[1:])
