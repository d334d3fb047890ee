"""A real Slurm cluster on this machine, for end-to-end tests: ``slurmctld`` and one ``slurmd``
per node, munge for authentication, each node in a network namespace of its own with its own
address and host name (``tests/netns.py``), the controller on the bridge's address (the
cluster's head node, where jobs are submitted and watched, as from a login node).

Debian's ``slurm-wlm`` (22.05) and ``munge``, installed by ``.ci/run``. What differs from a
default ``slurm.conf``, and why (everything else is Slurm's default, ``KillWait`` 30 s and
``SlurmdTimeout`` 300 s included)::

    SlurmUser=root, SlurmdUser=root     the tests run as root; jobs run as root
    AuthInfo=...,cred_expire=40         a requeued job may start again cred_expire + 1 s after
                                        its requeue (default 120: two minutes per requeue), and
                                        must not start sooner than KillWait + 2 s (below)

A requeued job keeps its id, and its first step is again step 0. The old incarnation's ``srun``,
SIGTERMed by the requeue while a task of its step is on a dead node, waits ``KillWait + 2`` s
(32) for that task, then sends SIGKILL to "step 0 of the job" once more: a requeued job started
by then loses its step to it ("srun: error: Timed out waiting for job step to complete" in the
new incarnation's output, and its tasks Killed). Slurm's default credential lifetime (120 s)
keeps a real cluster clear of it; a shorter one must stay above 32 s plus the slack of a busy
machine.
    SchedulerParameters=sched_interval=2  a requeued job waits for the main scheduling pass
                                        (default every 60 s); a new one is scheduled at once
    ProctrackType=proctrack/linuxproc   no cgroup delegation needed: a step's processes are
    TaskPlugin=task/none                found by their parents, as cgroups would find them
    SelectType=select/linear            whole nodes per job, one job at a time

Nothing outside the namespaces and a temporary folder is touched: munge's socket, keys, the
controller's state and every log live in the folder; ``/etc/netns/<namespace>/hosts`` (mounted
over ``/etc/hosts`` by ``ip netns exec``) exists only while the cluster does.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from tests import netns
from tests.netns import Network

CRED_EXPIRE_S = 40
"""How long a job credential lives: a requeued job starts again after it, 1 s and the next
scheduling pass (module docstring: above KillWait + 2 s, with room for a busy machine)."""

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "scontrol", "scancel")


def available() -> str | None:
    """Why a Slurm cluster cannot run here, or None when it can."""
    why = netns.available()
    if why is not None:
        return why
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if missing:
        return (f"{', '.join(missing)} not installed: apt-get install slurm-wlm munge "
                f"(.ci/run does)")
    return None


class Cluster:
    """``nodes`` Slurm nodes ``n0``, ``n1``, ... (node ``i`` at ``10.77.0.<i+1>``) and their
    controller. A context manager: started on entry (seconds), every process stopped and every
    namespace removed on exit."""

    def __init__(self, root: Path, nodes: int = 2) -> None:
        self.root = root
        self.names = [f"n{i}" for i in range(nodes)]
        self.net = Network(nodes, hosts=self.names, hub=True, hub_name="head")
        self.conf = root / "slurm.conf"
        self._munged: int | None = None

    # -- the cluster ------------------------------------------------------------------------------

    def __enter__(self) -> Cluster:
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            self.net.__enter__()
            self._start_munge()
            self._write_conf()
            self._daemon([*self.net.hub_prefix(), "slurmctld", "-f", str(self.conf)])
            for node in range(len(self.names)):
                self.start_node(node)
            self.until("every node idle", self.idle)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            self.run("scancel", "--user", "root", timeout=10)
        for node in range(len(self.names)):
            self.net.kill(node)
        with contextlib.suppress(OSError):  # the controller, in the bridge's namespace
            pids = subprocess.run(["ip", "netns", "pids", self.net.hub], capture_output=True,
                                  text=True).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
        if self._munged is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._munged, signal.SIGTERM)
        self.net.remove()

    def _start_munge(self) -> None:
        key = self.root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        pid = self.root / "munged.pid"
        subprocess.run(["munged", f"--socket={self.root / 'munge.sock'}", f"--key-file={key}",
                        f"--pid-file={pid}", f"--log-file={self.root / 'munged.log'}",
                        f"--seed-file={self.root / 'munged.seed'}", "--force"],
                       check=True, capture_output=True, timeout=30)
        self._munged = int(pid.read_text())

    def _write_conf(self) -> None:
        r = self.root
        (r / "state").mkdir(exist_ok=True)
        for name in self.names:
            (r / "spool" / name).mkdir(parents=True, exist_ok=True)
        nodes = "".join(f"NodeName={name} NodeAddr={self.net.address(i)} "
                        f"CPUs={os.cpu_count() or 1} RealMemory=1000 State=UNKNOWN\n"
                        for i, name in enumerate(self.names))
        self.conf.write_text(
            f"ClusterName=babysit\n"
            f"SlurmctldHost={socket.gethostname()}({self.net.hub_address})\n"
            f"SlurmUser=root\nSlurmdUser=root\n"
            f"AuthType=auth/munge\nCredType=cred/munge\n"
            f"AuthInfo=socket={r / 'munge.sock'},cred_expire={CRED_EXPIRE_S}\n"
            f"StateSaveLocation={r / 'state'}\n"
            f"SlurmdSpoolDir={r / 'spool'}/%n\n"
            f"SlurmctldPidFile={r / 'slurmctld.pid'}\nSlurmdPidFile={r}/slurmd-%n.pid\n"
            f"SlurmctldLogFile={r / 'slurmctld.log'}\nSlurmdLogFile={r}/slurmd-%n.log\n"
            f"SlurmctldDebug=info\nSlurmdDebug=info\n"
            f"ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n"
            f"SelectType=select/linear\nMpiDefault=none\nReturnToService=2\n"
            f"SlurmdParameters=config_overrides\n"
            f"SchedulerType=sched/builtin\nSchedulerParameters=sched_interval=2\n"
            f"JobCompType=jobcomp/none\nAccountingStorageType=accounting_storage/none\n"
            f"{nodes}"
            f"PartitionName=test Nodes={','.join(self.names)} Default=YES MaxTime=INFINITE "
            f"State=UP\n")
        (r / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n")

    def _daemon(self, command: list[str]) -> None:
        """Start a Slurm daemon (it detaches itself)."""
        done = subprocess.run(command, capture_output=True, text=True, timeout=60,
                              env=self.env())
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)}: {done.stderr.strip()}")

    def start_node(self, node: int) -> None:
        """Start node ``node``'s slurmd, in its namespace."""
        self._daemon([*self.net.prefix(node), "slurmd", "-f", str(self.conf),
                      "-N", self.names[node]])

    def kill_node(self, node: int) -> list[int]:
        """SIGKILL node ``node``'s slurmd and every process on it (a machine that died)."""
        return self.net.kill(node)

    def return_node(self, node: int) -> None:
        """Bring a node that died back, as its administrator would: its slurmd again, and the
        node marked down and resumed (which ends what the controller still held on it)."""
        self.start_node(node)
        name = self.names[node]
        self.run("scontrol", "update", f"NodeName={name}", "State=DOWN", "Reason=returned")
        self.run("scontrol", "update", f"NodeName={name}", "State=RESUME")
        self.until(f"{name} idle", lambda: self.state(name) == "idle")

    # -- as a user does ----------------------------------------------------------------------------

    def env(self, **extra: str) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf), **extra}

    def run(self, *command: str, timeout: float = 60, env: dict[str, str] | None = None,
            cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        """A Slurm command run on the head node (the bridge's namespace)."""
        return subprocess.run([*self.net.hub_prefix(), *command], capture_output=True, text=True,
                              timeout=timeout, env=env or self.env(), cwd=cwd)

    def sbatch(self, script: Path, *options: str, env: dict[str, str]) -> str:
        """Submit ``script`` from its folder; the job id."""
        done = self.run("sbatch", "--parsable", *options, str(script), env=env,
                        cwd=script.parent)
        if done.returncode != 0:
            raise RuntimeError(f"sbatch: {done.stderr.strip()}")
        return done.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields ({} once the job is forgotten)."""
        done = self.run("scontrol", "show", "job", "--oneliner", job_id)
        return dict(re.findall(r"(\w+)=(\S*)", done.stdout)) if done.returncode == 0 else {}

    def hostnames(self, hostlist: str) -> list[str]:
        """A Slurm host list (``n[3,6-7]``) as its hosts (``scontrol show hostnames``)."""
        return self.run("scontrol", "show", "hostnames", hostlist).stdout.split()

    def queued(self) -> list[str]:
        """``squeue``: every job the controller has, as ``id state``."""
        return self.run("squeue", "--noheader", "--format=%i %T").stdout.split("\n")[:-1]

    def states(self) -> dict[str, str]:
        """Each node's state, as ``sinfo`` says it (``idle``, ``allocated``, ``down*``...)."""
        out = self.run("sinfo", "--noheader", "--Node", "--format=%N %T").stdout
        return dict(line.split() for line in out.splitlines() if line.strip())

    def state(self, name: str) -> str:
        return self.states().get(name, "?")

    def free(self) -> int:
        """How many nodes are idle."""
        return list(self.states().values()).count("idle")

    def idle(self) -> bool:
        """Every node idle, and no job left (``sinfo``, ``squeue``)."""
        return self.free() == len(self.names) and not self.queued()

    def until(self, what: str, check: Callable[[], object], timeout: float = 120,
              every: float = 0.5) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}\n{self.logs()}")
            time.sleep(every)

    def logs(self) -> str:
        """The end of the controller's and every slurmd's log, for a failure's report."""
        parts = []
        for log in [self.root / "slurmctld.log", *sorted(self.root.glob("slurmd-*.log"))]:
            if log.exists():
                parts.append(f"--- {log.name}\n" + "".join(log.read_text().splitlines(True)[-15:]))
        return "\n".join(parts)
