"""Checks of what runs the job: torch and its backend, the GPUs, a checkpoint save and load."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from babysit.supervisor.commands.doctor.checks import nearest_existing
from babysit.supervisor.commands.doctor.core import (
    BABYSIT_ROOT,
    CheckResult,
    Context,
    ProbeError,
    Status,
    probe,
)
from babysit.supervisor.config.plan import RunPlan
from babysit.supervisor.services.health import GpuSample, Nvml


def expects_gpus(plan: RunPlan) -> bool:
    """Whether the config asks for GPUs. Configs do not name the backend, so it is inferred:
    ``nproc_per_node: gpu``, or a non-empty ``CUDA_VISIBLE_DEVICES`` in ``launch.env``, means
    GPUs and NCCL; anything else gloo on CPU (``auto`` follows whatever torch finds)."""
    launch = plan.config.launch
    visible = launch.env.get("CUDA_VISIBLE_DEVICES", "").strip()
    return launch.nproc_per_node == "gpu" or visible not in ("", "-1")


def torch_backend(plan: RunPlan, ctx: Context) -> CheckResult:
    """torch imports in the run's interpreter, with the distributed backend the config needs."""
    name = "torch"
    try:
        info = probe(plan, ctx, "torch", timeout_s=120)
    except ProbeError as exc:
        return CheckResult(name, Status.FAIL, str(exc),
                           "Set launch.python to a working interpreter (default: babysit's own).")
    if info["torch"] is None:
        return CheckResult(name, Status.FAIL, f"{plan.python} cannot import torch "
                           f"({info['error']})", f"`{plan.python} -m pip install torch`")
    version = f"torch {info['torch']}"
    if not info["distributed"]:
        return CheckResult(name, Status.FAIL, f"{version} was built without torch.distributed",
                           "Install an official torch build (pip or conda), which has it.")
    gpus = int(info["device_count"])
    nproc = plan.config.launch.nproc_per_node
    # `auto` gives one worker per GPU when torch sees any, else one per CPU.
    if gpus > 0 if nproc == "auto" else expects_gpus(plan):
        if gpus == 0:
            return CheckResult(
                name, Status.FAIL, f"the config asks for GPUs but {version} sees none (CUDA "
                f"build: {info['cuda_version'] or 'no, a CPU-only build'})",
                "Install a CUDA build of torch on a GPU node, check `nvidia-smi` and "
                "CUDA_VISIBLE_DEVICES, or set launch.nproc_per_node to a number for CPU.")
        if not info["nccl"]:
            return CheckResult(name, Status.FAIL, f"{version} sees {gpus} GPU(s) but has no "
                               "NCCL", "Install a CUDA build of torch from pytorch.org (it "
                               "ships NCCL).")
        if isinstance(nproc, int) and nproc > gpus:
            return CheckResult(name, Status.FAIL, f"{nproc} workers per node but only {gpus} "
                               "GPU(s) visible", "Lower launch.nproc_per_node, use "
                               "nproc_per_node: gpu, or fix CUDA_VISIBLE_DEVICES.")
        return CheckResult(name, Status.PASS, f"{version}, NCCL, {gpus} GPU(s) visible "
                           f"(CUDA {info['cuda_version']})")
    if not info["gloo"]:
        return CheckResult(name, Status.FAIL, f"{version} has no gloo backend for CPU runs",
                           "Install an official torch build (pip or conda), which has gloo.")
    if gpus:
        return CheckResult(
            name, Status.WARN, f"{version}, gloo; {gpus} GPU(s) visible but the config looks "
            f"CPU-only (nproc_per_node: {nproc}, no CUDA_VISIBLE_DEVICES in launch.env)",
            "If the script should use the GPUs, set launch.nproc_per_node: gpu; if it picks "
            "devices itself from LOCAL_RANK, ignore this.")
    return CheckResult(name, Status.PASS, f"{version}, gloo (CPU)")


def gpu_health(plan: RunPlan, ctx: Context) -> CheckResult:
    """Every GPU NVML sees: temperature, uncorrectable ECC errors, pages waiting for retirement,
    throttling. Skipped cleanly where NVML or the GPUs are missing."""
    name = "gpu health"
    nvml = Nvml(ctx.nvml)
    try:
        found, why = nvml.read()
    finally:
        nvml.close()
    if not found:
        reason = why or "NVML sees 0 GPUs"
        if expects_gpus(plan):
            return CheckResult(name, Status.WARN, f"cannot read GPU health ({reason})",
                               "Install nvidia-ml-py into babysit's environment and check "
                               "that `nvidia-smi` works on this node.")
        return CheckResult(name, Status.SKIP, f"no GPU: skipped ({reason})")
    limits = plan.config.health
    failures: list[str] = []
    warnings: list[str] = []
    fixes: dict[str, None] = {}  # ordered set
    for gpu in found:
        failures += _gpu_failures(gpu, fixes)
        if gpu.temperature_c is not None and gpu.temperature_c > limits.gpu_max_temperature_c:
            warnings.append(f"GPU {gpu.index} at {gpu.temperature_c:.0f} °C (above "
                            f"{limits.gpu_max_temperature_c:g} °C before any work)")
            fixes["Check the node's cooling, or drain it and use another node."] = None
        throttled = [r for r in gpu.throttle_reasons or () if r in limits.gpu_throttle_reasons]
        if throttled:
            warnings.append(f"GPU {gpu.index} throttled ({', '.join(throttled)})")
            fixes["Check the node's cooling and power limits (`nvidia-smi -q -d PERFORMANCE`)."] \
                = None
    problems = failures + warnings
    if problems:
        status = Status.FAIL if failures else Status.WARN
        return CheckResult(name, status, "; ".join(problems), " ".join(fixes))
    temps = [g.temperature_c for g in found if g.temperature_c is not None]
    models = sorted({g.name or "unknown" for g in found})
    heat = f", {min(temps):.0f}-{max(temps):.0f} °C" if temps else ""
    return CheckResult(name, Status.PASS, f"{len(found)} GPU(s) healthy ({', '.join(models)}"
                       f"{heat}, no ECC errors or pending page retirements)")


def _gpu_failures(gpu: GpuSample, fixes: dict[str, None]) -> list[str]:
    out = []
    if gpu.ecc_uncorrected_volatile:
        out.append(f"GPU {gpu.index}: {gpu.ecc_uncorrected_volatile} uncorrectable ECC "
                   "error(s) since the driver loaded")
        fixes["Drain the node for a GPU reset (nvidia-smi -r) or replacement."] = None
    if gpu.pages_pending:
        out.append(f"GPU {gpu.index}: memory pages waiting to be retired or remapped")
        fixes["Reset the GPU (nvidia-smi -r, or reboot) so the retirement takes effect."] = None
    return out


def checkpoint_io(plan: RunPlan, ctx: Context) -> CheckResult:
    """A real ``checkpoints.save`` and ``checkpoints.load`` of a tiny model and optimizer, in the
    run's interpreter, in a scratch folder where the checkpoints will go; then deleted."""
    name = "checkpoint io"
    where = nearest_existing(plan.checkpoint_dir)
    if not where.is_dir():
        return CheckResult(name, Status.SKIP, "not tried: checkpoints.dir is unusable (above)")
    try:
        scratch = Path(tempfile.mkdtemp(prefix=".babysit-doctor-", dir=where))
    except OSError as exc:
        return CheckResult(name, Status.FAIL, f"cannot create a scratch folder in {where} "
                           f"({exc.strerror})", "Fix checkpoints.dir first (see above).")
    mode = "async" if plan.config.checkpoints.async_save else "sync"
    try:
        out = probe(plan, ctx, "roundtrip", {"dir": str(scratch), "fallback_path":
                    str(BABYSIT_ROOT), "async_save": mode == "async"}, timeout_s=180)
    except ProbeError as exc:
        return CheckResult(name, Status.FAIL, f"{mode} save and load in {where}: {exc}",
                           "Check free space and permissions there; the message above says "
                           "which step failed.")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if out["differ"]:
        return CheckResult(name, Status.FAIL, f"{mode} save and load in {where} restored "
                           f"different values: {', '.join(out['differ'])}",
                           "This is a bug in babysit's checkpoints or in torch's DCP; report it "
                           f"with the torch version ({out['torch']}).")
    return CheckResult(name, Status.PASS, f"{mode} save and load round trip in {where} "
                       f"restored every tensor ({out['bytes']} bytes, torch {out['torch']})")
