"""The crash classifier's table: what a person would call each of these deaths."""

from __future__ import annotations

import pytest

from babysit.policies.detectors import CrashClass, classify
from babysit.policies.types import Incident

TB = 'Traceback (most recent call last):\n  File "train.py", line 42, in <module>\n'
LOADER_TB = (TB + '  File "/site-packages/babysit/supervisor/rank/api.py", line 153, in batches\n'
             '    batch = _draw_batch(it)\n'
             '  File "/site-packages/babysit/supervisor/rank/api.py", line 581, in _draw_batch\n'
             '    return next(it)\n'
             '  File "/data/my_loader.py", line 9, in __iter__\n')

CASES = [
    (1, None, TB + "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB "
     "(GPU 0; 79.1 GiB total capacity)", CrashClass.OOM),
    (1, None, TB + "MemoryError", CrashClass.OOM),
    (None, 9, "step 1200 loss 2.1\n", CrashClass.KILLED),
    (-9, None, "[rank3] oom-kill: process 1234 killed\n", CrashClass.OOM),
    (1, None, TB + "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970,"
     " unhandled system error", CrashClass.NETWORK),
    (1, None, TB + "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] "
     "Connection closed by peer [10.0.0.3]:29500", CrashClass.NETWORK),
    (1, None, TB + "ConnectionResetError: [Errno 104] Connection reset by peer",
     CrashClass.NETWORK),
    (1, None, TB + "RuntimeError: Timed out waiting 1800000ms for send operation",
     CrashClass.NETWORK),
    (1, None, TB + "FloatingPointError: Loss is nan at step 1234", CrashClass.NUMERICAL),
    (1, None, "NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus", CrashClass.HARDWARE),
    (1, None, TB + "RuntimeError: CUDA error: an illegal memory access was encountered",
     CrashClass.HARDWARE),
    (1, None, "RuntimeError: CUDA error: uncorrectable ECC error encountered",
     CrashClass.HARDWARE),
    (1, None, TB + "KeyError: 'input_ids'", CrashClass.USER_CODE),
    (1, None, TB + "ValueError: expected 3 dims, got 2", CrashClass.USER_CODE),
    (None, 15, "", CrashClass.KILLED),
    # SIGKILLed while DCP's async checkpoint process (a child) printed its parent's death:
    # the child's traceback is not the cause (seen with checkpoints.async_save).
    (-9, None, "step 4499\nProcess SpawnProcess-1:\n"
     + TB.replace("train.py", "multiprocessing/connection.py") + "EOFError", CrashClass.KILLED),
    # ...or, as often, a reset pipe: no network fault either (a child's words name no class).
    (-9, None, "step 4499\nProcess SpawnProcess-1:\n"
     + TB.replace("train.py", "multiprocessing/connection.py")
     + "ConnectionResetError: [Errno 104] Connection reset by peer", CrashClass.KILLED),
    # The script's own exception, then torchrun's SIGTERM while it was exiting: still its bug.
    (-15, None, TB + "RuntimeError: uploading the final model failed", CrashClass.USER_CODE),
    (-9, None, TB + "MemoryError", CrashClass.OOM),  # what the log says still counts
    (3, None, "", CrashClass.UNKNOWN),
    # Raised by the data loader as run.batches() drew a batch: the data's until shown otherwise.
    (1, None, LOADER_TB + "ValueError: corrupt sample in shard-00042.tar", CrashClass.DATA),
    # ...through a DataLoader worker, re-raised in the rank: the same.
    (1, None, LOADER_TB.replace("my_loader.py", "torch/utils/data/_utils/__init__.py")
     + "ValueError: Caught ValueError in DataLoader worker process 0.", CrashClass.DATA),
    # The loop's own code, after the batch was drawn (no loader frame in the traceback).
    (1, None, TB + "ValueError: corrupt sample in shard-00042.tar", CrashClass.USER_CODE),
    # An OOM while loading is an OOM.
    (1, None, LOADER_TB + "MemoryError", CrashClass.OOM),
    # The loader's frame in an earlier traceback, handled; the last one is the training's.
    (1, None, LOADER_TB + "OSError: retrying\n" + TB + "KeyError: 'input_ids'",
     CrashClass.USER_CODE),
]


@pytest.mark.parametrize(("exit_code", "sig", "log", "expected"), CASES)
def test_classification(exit_code: int | None, sig: int | None, log: str,
                        expected: CrashClass) -> None:
    assert classify(exit_code, sig, log, step=10).crash_class is expected


def test_signature_strips_what_varies_between_identical_crashes() -> None:
    a = classify(1, None, TB + "RuntimeError: bad value 0x7f3a2b at /tmp/tmpab12/x.pt, 12 items",
                 step=5)
    b = classify(1, None, TB + "RuntimeError: bad value 0x11ee00 at /tmp/tmpzz99/x.pt, 7 items",
                 step=5)
    assert a.signature == b.signature
    assert a.signature.startswith("RuntimeError: bad value")
    assert "0x7f" not in a.signature


def test_the_finding_shows_the_scripts_own_message_not_the_masked_signature() -> None:
    v = classify(1, None, TB + "RuntimeError: user fault: deliberate crash at step 1200",
                 step=1200)
    assert v.signature == "RuntimeError: user fault: deliberate crash at step N"
    message = v.to_finding(ranks=(1,)).message
    assert message.endswith(": RuntimeError: user fault: deliberate crash at step 1200")
    # Nothing to mask, nothing said twice: the signature is the message.
    assert classify(1, None, TB + "KeyError: 'input_ids'", step=3).said == ""


def test_same_signature_at_same_step_is_deterministic() -> None:
    log = TB + "KeyError: 'input_ids'"
    first = classify(1, None, log, step=1200)
    assert not first.deterministic
    again = classify(1, None, log, step=1200, previous=[first.key()])
    assert again.deterministic
    elsewhere = classify(1, None, log, step=1300, previous=[first.key()])
    assert not elsewhere.deterministic


def test_verdict_becomes_a_crash_finding() -> None:
    v = classify(1, None, TB + "MemoryError", step=7)
    f = v.to_finding(ranks=(3,))
    assert f.incident is Incident.CRASH and f.step == 7 and f.ranks == (3,)
    assert f.evidence["class"] == "oom" and f.evidence["deterministic"] is False


# torch 2.x's CUDA caching allocator message, whole, as torchrun's per-rank log shows it (the
# "[rank0]:" prefix is torchrun's); the numbers vary, the wording does not. The second is an OOM
# that surfaces inside NCCL, which must stay an OOM and not become a network error.
CUDA_OOM = (
    "[rank0]: Traceback (most recent call last):\n"
    '[rank0]:   File "/work/train.py", line 88, in <module>\n'
    "[rank0]:     logits = model(x)\n"
    "[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 19.68 GiB. GPU 0 has "
    "a total capacity of 139.72 GiB of which 11.88 GiB is free. Including non-PyTorch memory, this "
    "process has 127.79 GiB memory in use. Of the allocated memory 126.44 GiB is allocated by "
    "PyTorch, and 43.59 MiB is reserved by PyTorch but unallocated. If reserved but unallocated "
    "memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
    "fragmentation.  See documentation for Memory Management  "
    "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)\n")
NCCL_OOM = (
    TB + "torch.distributed.DistBackendError: NCCL error in: "
    "/pytorch/torch/csrc/distributed/c10d/NCCLUtils.cpp:77, unhandled cuda error (run with "
    "NCCL_DEBUG=INFO for details), NCCL version 2.27.5\nncclUnhandledCudaError: Call to CUDA "
    "function failed.\nLast error:\nCuda failure 'out of memory'\n")


@pytest.mark.parametrize("log", [CUDA_OOM, NCCL_OOM])
def test_torch_cuda_out_of_memory_is_an_oom(log: str) -> None:
    verdict = classify(1, None, log, step=10)
    assert verdict.crash_class is CrashClass.OOM
    # Two OOMs that differ only in their figures are the same crash: the second is deterministic.
    again = log.replace("19.68", "20.01").replace("11.88", "0.5")
    assert classify(1, None, again, 10, previous=[verdict.key()]).deterministic


def test_a_child_process_traceback_after_the_scripts_own_does_not_name_the_crash() -> None:
    """The script raises; DCP's async checkpoint process, seeing its parent gone, prints
    EOFError after it. The crash is the script's KeyError."""
    log = (TB + "KeyError: 'input_ids'\n"
           "Process SpawnProcess-1:\n"
           'Traceback (most recent call last):\n  File "multiprocessing/connection.py", line 399\n'
           "    raise EOFError\nEOFError\n")
    verdict = classify(1, None, log, step=10)
    assert verdict.crash_class is CrashClass.USER_CODE
    assert verdict.signature == "KeyError: 'input_ids'"
    chained = log + ("\nDuring handling of the above exception, another exception occurred:\n\n"
                     + TB + "OSError: handle closed\n")  # still the child's
    assert classify(1, None, chained, step=10).signature == "KeyError: 'input_ids'"
    # A child's traceback that is the only one still names a crash with no signal...
    only = classify(1, None, log[log.index("Process SpawnProcess"):], step=10)
    assert only.crash_class is CrashClass.USER_CODE and only.signature == "EOFError"
    # ...but not one the signal explains.
    killed = classify(-9, None, log[log.index("Process SpawnProcess"):], step=10)
    assert killed.crash_class is CrashClass.KILLED and killed.signature == "signal SIGKILL"


def test_a_child_process_names_the_class_only_when_the_process_says_nothing() -> None:
    """The patterns read the process's own lines first: a child's network words lose to the
    script's own exception, and name the class only when nothing else does."""
    child = ("Process SpawnProcess-1:\n" + TB
             + "RuntimeError: [gloo/transport/tcp/pair.cc:534] Connection closed by peer\n")
    own_then_child = TB + "KeyError: 'input_ids'\n" + child
    assert classify(1, None, own_then_child, step=10).crash_class is CrashClass.USER_CODE
    alone = classify(1, None, child, step=10)
    assert alone.crash_class is CrashClass.NETWORK
    assert alone.signature.startswith("RuntimeError: [gloo/transport/tcp/pair.cc:N]")
