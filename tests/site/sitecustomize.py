"""Read by every Python process the test suite starts (``tests/conftest.py`` puts this folder
first on ``PYTHONPATH``): babysitters, torchruns, ranks, the clean reference runs.

Two settings of the interpreter's garbage collector, for the suite's CPU, which is nearly all
interpreter starts and exits of processes that import torch (``docs/measured.md#ci``):

- **Fewer full collections.** A full collection walks every object alive, and torch makes about
  a million at import. With the interpreter's thresholds (700, 10, 10) a rank's start-up
  (torch, ``torch._dynamo`` under DDP, the checkpoint code, babysit's worker side) ran 5 full
  collections: 0.45 of its 2.4 CPU-seconds here. The third threshold at 100 instead of 10 asks
  for ten times as many collections of the younger generations between two full ones: none
  during a start-up, still some in a long process; the young generations are collected as
  before.
- **No last collection at exit.** That pass walks the same objects again: 0.6-0.7 CPU-s for
  each rank that ends on its own, 0.35 for each torchrun.

Nothing babysit watches or decides sees the difference: a rank's end is judged by its exit
status and its run's ``close()``, its progress by its steps; Python never promised when (or
whether, at exit) a cycle of garbage is collected. References still drop at once, files still
flush and close. Users' own processes keep the interpreter's defaults.
"""

import atexit
import gc

_young, _middle, _ = gc.get_threshold()
gc.set_threshold(_young, _middle, 100)
atexit.register(gc.freeze)
