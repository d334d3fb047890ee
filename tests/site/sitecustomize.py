"""Read by every Python process the test suite starts (``tests/conftest.py`` puts this folder
first on ``PYTHONPATH``): babysitters, torchruns, ranks, the clean reference runs.

At exit such a process skips the interpreter's last garbage collection. With torch imported that
pass walks every object torch (and the ``torch._dynamo`` that DDP's constructor imports) made:
0.6-0.7 CPU-seconds for each rank that ends on its own, 0.35 for each torchrun, where the whole
rank's start costs about 2.7. The suite ends hundreds of them on 2 cores, so it was about a
sixth of its CPU (``docs/measured.md#ci``). Nothing babysit watches or decides sees the
difference: a rank's end is judged by its exit status and its run's ``close()``, both as before;
Python never promised to finalize what is still alive at exit. Frozen objects are only left out
of collections; references still drop, files still flush and close.
"""

import atexit
import gc

atexit.register(gc.freeze)
