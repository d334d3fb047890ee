"""``babysit doctor``: real subprocesses in the run's interpreter, real files, real sockets, a real
HTTP server on loopback. The only fake is the NVML module (a test cannot make a GPU run hot); this
machine has no GPU, so the "no GPU" path runs for real."""

from __future__ import annotations

import io
import json
import socket
import subprocess
import sys
import textwrap
import threading
import types
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from babysit.checkpoints import register_external
from babysit.supervisor.commands.doctor import (
    Check,
    CheckResult,
    Context,
    Status,
    alerting,
    checks,
    doctor_main,
    fast_checks,
    load,
    network,
    render,
    runtime,
    verdict,
)
from babysit.supervisor.commands.doctor.core import run_one
from babysit.supervisor.config.plan import RunPlan
from babysit.supervisor.services.health import Nvml
from tests.conftest import ROOT

SECRET = "/services/T000/B000/very-secret-token"


def plan_of(tmp_path: Path, body: str, script: str | None = "import json\n") -> RunPlan:
    """A plan from a config whose launch section defaults to a script ``train.py`` in tmp_path."""
    if script is not None:
        (tmp_path / "train.py").write_text(script)
    path = tmp_path / "run.yaml"
    path.write_text(textwrap.dedent(body))
    first, plan = load(str(path))
    assert first.status is Status.PASS, first
    assert plan is not None
    return plan


def by_name(out: str) -> dict[str, dict[str, Any]]:
    return {r["name"]: r for r in json.loads(out)}


# -- whole runs of doctor --------------------------------------------------------------------------


def test_the_demo_config_is_ready(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the default run_dir is relative to where babysit starts
    out = io.StringIO()
    code = doctor_main(str(ROOT / "configs" / "demo.yaml"), send_alert=False, as_json=False,
                       out=out)
    text = out.getvalue()
    assert code == 0, text
    assert "FAIL" not in text and "READY" in text.splitlines()[-1], text
    for line in ("ok    script ", "ok    torch ", "ok    checkpoint io ", "skip  rendezvous "):
        assert line in text, text
    assert not list(tmp_path.rglob("*")), "doctor left files behind"


def test_a_broken_config_fails_each_problem_with_its_fix(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DOCTOR_TEST_SLACK_URL", raising=False)
    (tmp_path / "train.py").write_text("import os\nimport torch\nimport wandb_typo_xyz\n")
    (tmp_path / "a-file").write_text("")  # root can write anywhere, but not inside a file
    config = tmp_path / "broken.yaml"
    config.write_text(textwrap.dedent(f"""\
        launch: {{script: train.py, nproc-per-node: 2}}
        run_dir: {tmp_path / "runs"}
        checkpoints: {{dir: a-file/ckpts}}
        alerts:
          sinks: [{{name: team-slack, kind: slack, url_env: DOCTOR_TEST_SLACK_URL}}]
        """))
    out = io.StringIO()
    code = doctor_main(str(config), send_alert=False, as_json=True, out=out)
    results = by_name(out.getvalue())

    assert code == 1
    assert all(set(r) == {"name", "status", "summary", "fix", "seconds"} for r in results.values())
    assert results["config"]["status"] == "pass"  # the schema is fine; the environment is not
    assert results["script"]["status"] == "fail"
    assert "wandb_typo_xyz" in results["script"]["summary"]
    assert "pip install wandb_typo_xyz" in results["script"]["fix"]
    assert "torch" not in results["script"]["summary"]
    assert results["checkpoints.dir"]["status"] == "fail"
    assert "is a file" in results["checkpoints.dir"]["summary"]
    assert results["run_dir"]["status"] == "pass"
    assert results["checkpoint io"]["status"] == "skip"
    assert results["alert config"]["status"] == "fail"
    assert "$DOCTOR_TEST_SLACK_URL" in results["alert config"]["summary"]
    assert "export DOCTOR_TEST_SLACK_URL=https://" in results["alert config"]["fix"]


def test_an_invalid_config_fails_alone_with_the_key(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("launch: {script: train.py, nproc_per_nod: 2}\n")
    out = io.StringIO()
    assert doctor_main(str(config), send_alert=False, as_json=False, out=out) == 1
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("FAIL  config") and "nproc_per_node" in lines[0]
    assert lines[-1].startswith("NOT READY")


def test_fast_checks_import_no_torch_and_skip_the_slow_ones(tmp_path: Path) -> None:
    # A fresh interpreter: this pytest process may have imported torch for other tests.
    code = textwrap.dedent(f"""\
        import json, sys, time
        from babysit.supervisor.config.plan import from_file
        from babysit.supervisor.commands.doctor import fast_checks
        plan = from_file({str(ROOT / "configs" / "demo.yaml")!r})
        start = time.monotonic()
        results = fast_checks(plan)
        print(json.dumps({{"seconds": time.monotonic() - start, "torch": "torch" in sys.modules,
                          "results": [r.to_json() for r in results]}}))
        """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60, check=True)
    got = json.loads(proc.stdout)
    assert got["torch"] is False
    assert got["seconds"] < 2.0, got
    names = [r["name"] for r in got["results"]]
    assert names[:2] == ["config", "script"] and "alert config" in names
    assert not {"torch", "checkpoint io", "gpu health", "alert sinks"} & set(names)
    assert all(r["status"] != "fail" for r in got["results"]), got


def test_problems_only_rendering_keeps_warnings_failures_and_the_verdict() -> None:
    results = [CheckResult("a", Status.PASS, "fine"), CheckResult("b", Status.SKIP, "n/a"),
               CheckResult("c", Status.WARN, "hmm", "do x"), CheckResult("d", Status.FAIL, "no",
                                                                        "do y")]
    lines = render(results, problems_only=True).splitlines()
    assert [line.split()[0] for line in lines] == ["WARN", "fix:", "FAIL", "fix:", "NOT"]


def test_a_check_that_crashes_becomes_a_failure(tmp_path: Path) -> None:
    def broken(plan: RunPlan, ctx: Context) -> CheckResult:
        raise KeyError("surprise")

    result = run_one(Check("broken", broken, fast=True), plan_of(tmp_path, """\
        launch: {script: train.py}
        """), Context())
    assert result.status is Status.FAIL and "KeyError" in result.summary


# -- script and interpreter ------------------------------------------------------------------------


def test_imports_are_resolved_by_the_runs_interpreter_and_path(tmp_path: Path) -> None:
    (tmp_path / "helpers.py").write_text("")  # beside the script: found, as `python train.py`
    plan = plan_of(tmp_path, """\
        launch: {script: train.py}
        """, script="import os.path\nfrom helpers import x\ntry:\n    import optional_xyz\n"
                    "except ImportError:\n    pass\n\ndef f():\n    import lazy_xyz\n")
    result = checks.script(plan, Context(cwd=tmp_path.parent))
    assert result.status is Status.PASS, result  # try/except and function-level imports: optional

    # Another interpreter, the run's: here babysit's own without site-packages. yaml is in
    # babysit's environment but not in the run's, so it must fail.
    other = tmp_path / "python-without-site"
    other.write_text(f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")
    other.chmod(0o755)
    plan = plan_of(tmp_path, f"""\
        launch: {{script: train.py, python: {other}}}
        """, script="import json\nimport yaml\n")
    result = checks.script(plan, Context())
    assert result.status is Status.FAIL, result
    assert "imports yaml, which" in result.summary and str(other) in (result.fix or "")


def test_imports_after_a_sys_path_edit_only_warn(tmp_path: Path) -> None:
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "mylib_xyz.py").write_text("")
    plan = plan_of(tmp_path, "launch: {script: train.py}\n", script=(
        "import sys\nimport absent_before_xyz\nsys.path.insert(0, 'lib')\nimport mylib_xyz\n"))
    result = checks.script(plan, Context())
    assert result.status is Status.FAIL and "absent_before_xyz" in result.summary
    assert "mylib_xyz" not in result.summary  # a failure trumps the uncertain one
    (tmp_path / "train.py").write_text("import sys\nsys.path.insert(0, 'lib')\nimport mylib_xyz\n")
    result = checks.script(plan, Context())
    assert result.status is Status.WARN and "mylib_xyz after changing sys.path" in result.summary


def test_a_module_launch_and_a_missing_interpreter(tmp_path: Path) -> None:
    plan = plan_of(tmp_path, """\
        launch: {module: json.tool}
        """, script=None)
    assert checks.script(plan, Context()).status is Status.PASS
    plan = plan_of(tmp_path, """\
        launch: {module: no_such_module_xyz}
        """, script=None)
    result = checks.script(plan, Context())
    assert result.status is Status.FAIL and "no_such_module_xyz" in result.summary
    plan = plan_of(tmp_path, f"""\
        launch: {{script: train.py, python: {tmp_path / "nope" / "python"}}}
        """)
    result = runtime.torch_backend(plan, Context())
    assert result.status is Status.FAIL and "does not exist" in result.summary


def test_a_run_interpreter_without_torch_fails_the_torch_check(tmp_path: Path) -> None:
    plan = plan_of(tmp_path, """\
        launch: {script: train.py, python: /usr/bin/python3}
        """)
    if subprocess.run(["/usr/bin/python3", "-c", "import torch"], capture_output=True).returncode \
            == 0:
        pytest.skip("the system Python has torch")
    result = runtime.torch_backend(plan, Context())
    assert result.status is Status.FAIL and "cannot import torch" in result.summary
    assert "pip install torch" in (result.fix or "")


# -- GPUs ----------------------------------------------------------------------------------------


def fake_nvml(gpus: list[dict[str, Any]]) -> types.ModuleType:
    """A stand-in for ``pynvml`` with the calls ``services.health.Nvml`` makes."""
    m = types.ModuleType("pynvml")
    mem = types.SimpleNamespace(used=0, total=80 * 1024**3)
    m.__dict__.update(
        nvmlInit=lambda: None, nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: len(gpus), nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetName=lambda h: "NVIDIA H100",
        nvmlDeviceGetTemperature=lambda h, sensor: gpus[h].get("temp", 35),
        nvmlDeviceGetTotalEccErrors=lambda h, kind, counter: gpus[h].get("ecc", 0),
        nvmlDeviceGetRetiredPagesPendingStatus=lambda h: gpus[h].get("retired", 0),
        nvmlDeviceGetCurrentClocksThrottleReasons=lambda h: gpus[h].get("throttle", 0x1),
        nvmlDeviceGetMemoryInfo=lambda h: mem,
    )
    return m


def test_without_gpus_the_gpu_check_is_skipped_for_real(tmp_path: Path) -> None:
    probe = Nvml()
    gpus, _ = probe.read()
    probe.close()
    if gpus:
        pytest.skip("this machine has GPUs")
    cpu = plan_of(tmp_path, "launch: {script: train.py}\n")
    result = runtime.gpu_health(cpu, Context())
    assert result.status is Status.SKIP and result.summary.startswith("no GPU: skipped")
    gpu = plan_of(tmp_path, "launch: {script: train.py, nproc_per_node: gpu}\n")
    result = runtime.gpu_health(gpu, Context())
    assert result.status is Status.WARN and "nvidia-ml-py" in (result.fix or "")


@pytest.mark.parametrize(("gpus", "status", "words"), [
    ([{}, {"temp": 40}], Status.PASS, "2 GPU(s) healthy"),
    ([{}, {"temp": 93}], Status.WARN, "GPU 1 at 93 °C"),
    ([{"throttle": 0x40}], Status.WARN, "hw_thermal_slowdown"),
    ([{"ecc": 2}, {}], Status.FAIL, "GPU 0: 2 uncorrectable ECC"),
    ([{}, {"retired": 1, "temp": 95}], Status.FAIL, "waiting to be retired"),
])
def test_gpu_health_through_a_fake_nvml(tmp_path: Path, gpus: list[dict[str, Any]],
                                        status: Status, words: str) -> None:
    plan = plan_of(tmp_path, "launch: {script: train.py, nproc_per_node: gpu}\n")
    result = runtime.gpu_health(plan, Context(nvml=fake_nvml(gpus)))
    assert result.status is status and words in result.summary, result
    assert (result.fix is None) == (status is Status.PASS)


# -- folders and space ----------------------------------------------------------------------------


def test_disk_space_uses_the_newest_checkpoints_size(tmp_path: Path) -> None:
    ckpts = tmp_path / "ckpts"
    data = tmp_path / "mine.bin"
    data.write_bytes(b"x" * 4096)
    register_external(ckpts, data, step=10, cursor=10, world_size=1)
    plan = plan_of(tmp_path, f"launch: {{script: train.py}}\ncheckpoints: {{dir: {ckpts}}}\n")
    result = checks.disk_space(plan, Context())
    assert result.status is Status.PASS and "step 10's size" in result.summary, result

    plan = plan_of(tmp_path, "launch: {script: train.py}\nrun_dir: runs\n"
                             "health: {expected_checkpoint_gib: 1000000}\n")
    result = checks.disk_space(plan, Context())
    assert result.status is Status.FAIL and "keep=3" in result.summary
    assert "checkpoints.keep" in (result.fix or "")


# -- rendezvous ----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rdzv(tmp_path: Path, launch: str) -> CheckResult:
    return network.rendezvous(plan_of(tmp_path, f"launch: {{script: train.py, {launch}}}\n"),
                              Context())


@pytest.fixture
def held_port() -> Iterator[tuple[int, int]]:
    """A port another process listens on, on loopback: (its pid, the port)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import socket, sys\n"
         "s = socket.create_server(('127.0.0.1', 0))\n"
         "print(s.getsockname()[1], flush=True)\nsys.stdin.read()\n"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        yield proc.pid, int(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait()


def test_a_multinode_config_without_a_place_to_meet_fails(tmp_path: Path) -> None:
    assert rdzv(tmp_path, "nnodes: 1").status is Status.SKIP
    assert rdzv(tmp_path, "nnodes: 2").status is Status.FAIL
    result = rdzv(tmp_path, "nnodes: 2, node_rank: 1, rdzv_endpoint: 'node0:port'")
    assert result.status is Status.FAIL and "is not host:port" in result.summary


def test_on_node_0_a_port_another_process_holds_warns_naming_that_process(
        tmp_path: Path, held_port: tuple[int, int]) -> None:
    pid, port = held_port
    result = rdzv(tmp_path, f"nnodes: 2, node_rank: 0, rdzv_endpoint: '127.0.0.1:{port}'")
    assert result.status is Status.WARN, result
    assert result.summary.startswith(f"pid {pid} (python") and "socket.create_server" in \
        result.summary, result
    assert result.summary.endswith(f") holds port {port} on this node, where its torchrun "
                                   f"opens the rendezvous store (127.0.0.1:{port})")
    assert "Stop that process, or pick another port" in (result.fix or "")


def test_on_node_0_a_free_port_is_where_its_torchrun_opens_the_store(tmp_path: Path) -> None:
    port = free_port()
    result = rdzv(tmp_path, f"nnodes: 2, node_rank: 0, rdzv_endpoint: '127.0.0.1:{port}'")
    assert result.status is Status.PASS, result
    assert result.summary == (f"port {port} is free on this node: its torchrun opens the "
                              f"rendezvous store at 127.0.0.1:{port} when the run starts")


def test_a_follower_started_before_node_0_is_ready_without_warnings(tmp_path: Path) -> None:
    """Nothing listens at the endpoint yet: the expected state of a start, one quiet line in
    doctor's table, and nothing at all on ``babysit run``'s console."""
    port = free_port()
    plan = plan_of(tmp_path, f"""\
        launch: {{script: train.py, nnodes: 2, node_rank: 1, rdzv_endpoint: '127.0.0.1:{port}'}}
        nodes: {{secret: '0123456789abcdefgh'}}
        prometheus: {{enabled: false}}
        """)
    results = fast_checks(plan)
    (result,) = [r for r in results if r.name == "rendezvous"]
    assert result.status is Status.PASS, result
    assert result.summary == (f"nothing listens at 127.0.0.1:{port} yet, as expected before "
                              "node 0's torchrun opens the rendezvous store there")
    assert verdict(results).startswith("READY: "), render(results)
    assert render(results, problems_only=True) == verdict(results) + "\n"


def test_a_follower_after_node_0_started_finds_the_store_up(
        tmp_path: Path, held_port: tuple[int, int]) -> None:
    _, port = held_port
    result = rdzv(tmp_path, f"nnodes: 2, node_rank: 1, rdzv_endpoint: '127.0.0.1:{port}'")
    assert result.status is Status.PASS, result
    assert result.summary == f"127.0.0.1:{port} answers: node 0's rendezvous store is up"


@pytest.mark.parametrize("launch", [
    "nnodes: 2, node_rank: 0, rdzv_endpoint: 'no-such-host.invalid:29400'",
    "nnodes: 2, node_rank: 1, rdzv_endpoint: 'no-such-host.invalid:29400'",
    "nnodes: 2, node_rank: 1}\nnodes: {leader: 'no-such-host.invalid:29401'",
])
def test_a_name_that_does_not_resolve_warns(tmp_path: Path, launch: str) -> None:
    result = rdzv(tmp_path, launch)
    assert result.status is Status.WARN, result
    assert "'no-such-host.invalid' does not resolve (" in result.summary
    assert "nodes.join_timeout_s" in (result.fix or "")


def test_node_address_says_where_the_others_reach_this_node(tmp_path: Path) -> None:
    single = network.node_address(plan_of(tmp_path, "launch: {script: train.py}\n"), Context())
    assert single.status is Status.SKIP
    plan = plan_of(tmp_path, "launch: {script: train.py, nnodes: 2, node_rank: 1, "
                             "rdzv_endpoint: '127.0.0.1:29400'}\nnodes: {secret: "
                             "'0123456789abcdefgh'}\n")
    result = network.node_address(plan, Context())
    # The route to a leader on loopback leaves from loopback: nothing to warn about.
    assert result.status is Status.PASS, result
    assert "at 127.0.0.1 (lo)" in result.summary and "--local-addr 127.0.0.1" in result.summary


# -- alert sinks, against a real HTTP server on loopback ------------------------------------------


class Hooks:
    """Answers like Slack (400 invalid_payload to an empty POST) on /slack, 404 no_service on
    /gone, and 200 to anything else; records every request."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, bytes]] = []
        hooks = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, method: str) -> None:
                size = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(size) if size else b""
                hooks.requests.append((method, self.path, body))
                status, text = 200, b"ok"
                if self.path.startswith("/slack") and method == "POST" and not body:
                    status, text = 400, b"invalid_payload"
                elif self.path.startswith("/gone"):
                    status, text = 404, b"no_service"
                self.send_response(status)
                self.send_header("Content-Length", str(len(text)))
                self.end_headers()
                if method != "HEAD":
                    self.wfile.write(text)

            def do_POST(self) -> None:
                self._answer("POST")

            def do_HEAD(self) -> None:
                self._answer("HEAD")

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02},
                         daemon=True).start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}{path}{SECRET}"


@pytest.fixture
def hooks() -> Iterator[Hooks]:
    h = Hooks()
    yield h
    h.server.shutdown()
    h.server.server_close()


def alert_plan(tmp_path: Path) -> RunPlan:
    return plan_of(tmp_path, """\
        launch: {script: train.py}
        alerts:
          sinks:
            - {name: team-slack, kind: slack, url_env: T_SLACK, timeout_s: 2}
            - {name: pager, kind: webhook, url_env: T_HOOK, timeout_s: 2}
        """)


def test_sinks_are_probed_without_sending_an_alert(tmp_path: Path, hooks: Hooks) -> None:
    plan = alert_plan(tmp_path)
    env = {"T_SLACK": hooks.url("/slack"), "T_HOOK": hooks.url("/hook")}
    assert alerting.alert_config(plan, Context(environ=env)).status is Status.PASS
    result = alerting.alert_sinks(plan, Context(environ=env))
    assert result.status is Status.PASS, result
    assert [(m, p.split("/")[1]) for m, p, _ in hooks.requests] == [("POST", "slack"),
                                                                    ("HEAD", "hook")]
    assert all(body == b"" for _, _, body in hooks.requests)  # nothing that could be posted
    assert SECRET not in result.summary and "127.0.0.1" not in result.summary


def test_a_revoked_or_unreachable_sink_fails_without_showing_its_url(
        tmp_path: Path, hooks: Hooks) -> None:
    plan = alert_plan(tmp_path)
    env = {"T_SLACK": hooks.url("/gone"), "T_HOOK": f"http://127.0.0.1:{free_port()}{SECRET}"}
    result = alerting.alert_sinks(plan, Context(environ=env))
    assert result.status is Status.FAIL
    assert "'team-slack' refused (HTTP 404 no_service)" in result.summary
    assert "'pager' connection failed" in result.summary
    assert SECRET not in result.summary + (result.fix or "")


def test_send_alert_sends_a_real_test_alert(tmp_path: Path, hooks: Hooks) -> None:
    plan = alert_plan(tmp_path)
    env = {"T_SLACK": hooks.url("/slack"), "T_HOOK": hooks.url("/hook")}
    result = alerting.alert_sinks(plan, Context(environ=env, send_alert=True))
    assert result.status is Status.PASS, result
    assert [m for m, _, _ in hooks.requests] == ["POST", "POST"]
    assert all(b"babysit alert test" in body for _, _, body in hooks.requests)


def test_a_taken_metrics_port_fails_before_the_run_naming_the_key(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        plan = plan_of(tmp_path, f"""\
            launch: {{script: train.py}}
            prometheus: {{enabled: true, port: {port}}}
            """)
        result = checks.metrics_port(plan, Context())
    assert result.status is Status.FAIL and f"127.0.0.1:{port}" in result.summary
    assert result.fix is not None and "prometheus.port" in result.fix
    assert checks.metrics_port(plan, Context()).status is Status.PASS  # released: free again
    off = plan_of(tmp_path, "launch: {script: train.py}\n")
    assert checks.metrics_port(off, Context()).status is Status.SKIP
