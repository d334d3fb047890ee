"""The loop's background services at the end of a run: the final metrics' linger."""

from __future__ import annotations

import threading
from pathlib import Path

from babysit.supervisor.config import plan as plan_mod
from babysit.supervisor.config import schema as cfg
from babysit.supervisor.run.background import Services
from babysit.supervisor.services.alerts import AlertDispatcher


def _services(tmp_path: Path) -> Services:
    (tmp_path / "train.py").write_text("")
    config = cfg.parse({"launch": {"script": "train.py"},
                        "prometheus": {"enabled": True, "port": 0, "linger_s": 60}}, "t.yaml")
    plan = plan_mod.resolve(config, tmp_path, "t.yaml", "t", str(tmp_path / "run"), check=False)
    return Services(plan, AlertDispatcher([]))


def test_a_stop_asked_before_the_linger_began_ends_it_at_once(tmp_path: Path) -> None:
    # A Ctrl-C between the run's end and the linger's own handler reached the loop's handler;
    # the linger must still hear it instead of serving for the full 60 s.
    services = _services(tmp_path)
    services.start()
    said: list[str] = []
    stopper = threading.Thread(target=services.stop, args=(said.append, lambda: True))
    stopper.start()
    stopper.join(timeout=20)
    assert not stopper.is_alive(), "the linger ignored a stop asked before it began"
    assert any("serving the final metrics" in line for line in said)
