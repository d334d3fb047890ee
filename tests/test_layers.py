"""The house rules of the package: one top-level import name, and rooms that import only
downwards (the order in ``supervisor/__init__.py``), with no import cycles. Every import
statement counts, wherever it stands: one deferred into a function still ties the two modules.

A user's own ``checkpoints.py`` or ``policies/`` beside their script must never meet ours, so the
wheel holds ``babysit`` and nothing else; the end-to-end half of that is the rollback run from
such a folder in ``tests/e2e/test_recovery.py``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import ROOT

ROOMS = ("contract", "rank", "services", "config", "node", "run", "cluster", "commands")
"""supervisor/'s rooms, lowest first: a room may import its own and the ones before it."""
PACKAGES = ("checkpoints", "policies", "supervisor")


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (``babysit.supervisor.run.loop``)."""
    found = {"babysit": ROOT / "babysit" / "__init__.py"}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(("babysit", *parts))] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that ``name`` imports anywhere in its source: at the top, inside a
    function (a deferred import is still a dependency, and hides a cycle until the function
    runs), or under ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text(), str(path))
    out: set[str] = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("babysit"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                base = ".".join(anchor[:len(anchor) - node.level + 1] + ([base] if base else []))
            if not base.startswith("babysit"):
                continue
            for alias in node.names:  # `from pkg import module` imports the module itself
                sub = f"{base}.{alias.name}"
                out.add(sub if sub in known else base)
    return {m for m in out if m in known and m != name}


def room(module: str) -> str | None:
    parts = module.split(".")
    if len(parts) >= 3 and parts[1] == "supervisor" and parts[2] in ROOMS:
        return parts[2]
    return None


GRAPH = {name: imports(name, path, set(modules()))
         for name, path in modules().items()}


def test_the_room_order_is_the_one_the_package_documents() -> None:
    doc = (ROOT / "supervisor" / "__init__.py").read_text()
    listed = [line.split()[0].rstrip("/") for line in doc.splitlines()
              if line.startswith("    ") and line.split()[0].endswith("/")]
    assert tuple(listed) == ROOMS


def test_every_supervisor_module_lives_in_a_room() -> None:
    loose = [m for m in GRAPH if m.startswith("babysit.supervisor.") and room(m) is None]
    assert loose == [], "put these in a room (see supervisor/__init__.py)"


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_imports_point_down_only(module: str) -> None:
    here = room(module)
    for target in GRAPH[module]:
        if module.startswith(("babysit.policies", "babysit.checkpoints")):
            assert not target.startswith("babysit.supervisor"), \
                f"{module} (a library below the supervisor) imports {target}"
        there = room(target)
        if here is not None and there is not None:
            assert ROOMS.index(there) <= ROOMS.index(here), \
                f"{module} ({here}/) imports {target} ({there}/), a room above it"


def test_no_import_cycles() -> None:
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            cycle = [*path[path.index(node):], node]
            raise AssertionError("import cycle: " + " -> ".join(cycle))
        if node in done:
            return
        for target in sorted(GRAPH[node]):
            visit(target, [*path, node])
        done.add(node)

    for start in sorted(GRAPH):
        visit(start, [])


def test_an_import_inside_a_function_is_an_edge_of_the_graph(tmp_path: Path) -> None:
    source = tmp_path / "late.py"
    source.write_text("def row():\n    from babysit.supervisor.node.sketch import StepSummary\n"
                      "    return StepSummary\n")
    assert imports("babysit.supervisor.node.late", source, set(modules())) == \
        {"babysit.supervisor.node.sketch"}


def test_the_rank_side_stays_light() -> None:
    """``import babysit`` runs in every training rank, and ``attach()`` builds the in-process
    grad-norm guard from the directive's settings there: no pydantic (a cost to each rank's
    start, docs/measured.md#ci), matplotlib or requests."""
    from babysit.policies.detectors.grad_norm import GradNormConfig

    settings = GradNormConfig().model_dump()
    code = ("import sys, babysit; from babysit.supervisor.rank.api import _grad_guard; "
            f"assert _grad_guard({settings!r}).observe_value(1, 1.0) is None; "
            "heavy = {'pydantic', 'matplotlib', 'requests', 'yaml', "
            "'apscheduler', 'prometheus_client', 'wandb', 'tensorboard'} & set(sys.modules); "
            "print(sorted(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout.strip()
    assert out == "[]"


def test_the_supervisor_imports_no_optional_library_it_is_not_asked_for() -> None:
    """The dashboards' and frameworks' libraries are imported only when a run enables them."""
    code = ("import sys, babysit.supervisor.commands.cli, babysit.supervisor.run.loop; "
            "optional = {'wandb', 'tensorboard', 'transformers', 'lightning'} & "
            "set(sys.modules); print(sorted(optional))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout.strip()
    assert out == "[]"


def test_the_control_loop_and_the_readme_keep_their_size() -> None:
    """Two sizes that drifted before (issue 55): ``Supervisor`` stays under 300 lines, read in
    one sitting (what belongs elsewhere moves there, rather than lines squeezed), and the
    README's "Where to go next" starts within its first 100 lines."""
    tree = ast.parse((ROOT / "supervisor" / "run" / "loop.py").read_text())
    [loop] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Supervisor"]
    assert loop.end_lineno is not None and loop.end_lineno - loop.lineno + 1 < 300
    readme = (ROOT / "README.md").read_text().splitlines()
    assert readme.index("## Where to go next") + 1 < 100


def test_the_wheel_holds_one_top_level_package(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(tmp_path), str(ROOT)],
                   check=True, capture_output=True, text=True, cwd=tmp_path)
    (wheel,) = tmp_path.glob("babysit-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"babysit"}
    assert "babysit/supervisor/run/loop.py" in names
    assert "babysit/policies/default.yaml" in names  # the built-in policies travel too
