"""What ``babysit doctor`` runs inside the run's own interpreter (``launch.python``).

This file is not imported by babysit: its source is passed to ``python -c`` with the run's
environment and working directory, so it sees exactly what the workers will see. It therefore
imports only the standard library at the top (torch and ``checkpoints`` inside the probes that
need them) and prints one JSON object on its last stdout line, after ``MARKER``.

    python -c SOURCE imports '{"script": PATH}' | '{"module": NAME}'
    python -c SOURCE torch
    python -c SOURCE roundtrip '{"dir": PATH, "async_save": false, "fallback_path": PATH}'
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import sys
from typing import Any

MARKER = "babysit-doctor-probe:"


def imports(args: dict[str, Any]) -> dict[str, Any]:
    """The script's (or module's) top-level absolute imports that do not resolve.

    Only the first component of each name is looked up (``torch`` for ``torch.nn``): finding a
    submodule imports its parent package, and importing torch costs seconds.
    """
    if args.get("script"):
        path = str(args["script"])
        # A script run as `python script.py` has its own folder first on sys.path (not the cwd).
        sys.path[0] = os.path.dirname(os.path.abspath(path))
    else:
        # `python -m module` has the working directory first on sys.path, as `-c` already does.
        try:
            spec = importlib.util.find_spec(str(args["module"]))
        except (ImportError, ValueError) as exc:
            spec, why = None, f"{type(exc).__name__}: {exc}"
        else:
            why = "not found"
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            return {"error": f"module {args['module']!r}: {why if spec is None else 'no source'}",
                    "missing_module": spec is None}
        path = spec.origin
    with open(path, "rb") as f:
        source = f.read()
    try:
        tree = ast.parse(source, filename=path)
    except SyntaxError as exc:
        return {"error": f"{path}, line {exc.lineno}: syntax error ({exc.msg})", "syntax": True}
    text = source.decode(errors="replace")
    names: dict[str, bool] = {}  # top-level name -> imported only after a sys.path edit
    edited = False
    for node in tree.body:  # top level only: imports in functions or try blocks are optional
        found: list[str] = []
        if isinstance(node, ast.Import):
            found = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found = [node.module]
        elif "sys.path" in (ast.get_source_segment(text, node) or ""):
            edited = True  # e.g. sys.path.insert(0, ...): later imports may rely on it
        for name in found:
            top = name.split(".", 1)[0]
            names[top] = names.get(top, edited)
    names.pop("__future__", None)
    missing: list[str] = []
    uncertain: list[str] = []
    for name, after_edit in sorted(names.items()):
        try:
            ok = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            ok = False
        if not ok:
            (uncertain if after_edit else missing).append(name)
    return {"path": path, "checked": sorted(names), "missing": missing, "uncertain": uncertain}


def torch_info(_: dict[str, Any]) -> dict[str, Any]:
    """torch's version and what its distributed backends and CUDA offer here."""
    try:
        import torch
    except Exception as exc:  # ImportError, or a broken install raising anything
        return {"torch": None, "error": f"{type(exc).__name__}: {exc}"}
    import torch.distributed as dist

    available = dist.is_available()
    cuda = torch.cuda.is_available()
    return {
        "torch": torch.__version__,
        "distributed": available,
        "gloo": bool(available and dist.is_gloo_available()),
        "nccl": bool(available and dist.is_nccl_available()),
        "cuda": cuda,
        "cuda_version": torch.version.cuda,
        "device_count": torch.cuda.device_count() if cuda else 0,
    }


def roundtrip(args: dict[str, Any]) -> dict[str, Any]:
    """Save a tiny model and optimizer with ``checkpoints.save`` into ``dir``, load them into
    fresh objects with ``checkpoints.load``, and compare every tensor. Single process: ``save``
    and ``load`` treat a missing process group as a world of one."""
    import warnings

    import torch

    # The run's own babysit install wins; this checkout's packages only fill in when it has none.
    sys.path.append(str(args["fallback_path"]))
    from babysit.checkpoints import load, save

    # DCP says, rightly, that it assumes a single process here.
    warnings.filterwarnings("ignore", message=".*assuming the intent is to")
    torch.manual_seed(0)

    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = torch.nn.Linear(8, 4)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    model, opt = build()
    model(torch.randn(2, 8)).sum().backward()
    opt.step()  # so the optimizer has state (moments) to save
    handle = save(args["dir"], 1, 7, 0.5, model, opt, async_save=bool(args["async_save"]))
    handle.wait(timeout_s=60)
    model2, opt2 = build()
    restored = load(handle.path, model2, opt2)
    loaded = model2.state_dict()
    differ = [k for k, v in model.state_dict().items() if not torch.equal(v, loaded[k])]
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    for pid, state in s1.items():
        for key, value in state.items():
            other = s2.get(pid, {}).get(key)
            same = (torch.equal(value, other) if isinstance(value, torch.Tensor)
                    and isinstance(other, torch.Tensor) else value == other)
            if not same:
                differ.append(f"optimizer state {pid}.{key}")
    if (restored.step, restored.cursor, restored.lr_scale) != (1, 7, 0.5):
        differ.append(f"step/cursor/lr_scale {restored.step}/{restored.cursor}/{restored.lr_scale}")
    size = sum(f.stat().st_size for f in handle.path.rglob("*") if f.is_file())
    return {"differ": differ, "bytes": size, "torch": torch.__version__}


PROBES = {"imports": imports, "torch": torch_info, "roundtrip": roundtrip}

if __name__ == "__main__":
    result = PROBES[sys.argv[1]](json.loads(sys.argv[2]) if len(sys.argv) > 2 else {})
    sys.stdout.write("\n" + MARKER + json.dumps(result) + "\n")
