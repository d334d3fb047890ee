"""Transition only: the names that callers outside ``node/`` still import from here.

A hang is confirmed in ``hang.py``, an incident folder is written by ``incident.py``, and a
crash of the teardown alone is told by ``teardown.py``. This module goes once ``run/loop.py``,
``run/members.py``, ``cluster/follower.py``, ``node/workers.py`` and
``tests/test_loop_members.py`` import from those instead.
"""

from __future__ import annotations

from babysit.supervisor.node.incident import write_incident
from babysit.supervisor.node.stacks import Diagnosis
from babysit.supervisor.node.teardown import teardown_only

__all__ = ["Diagnosis", "teardown_only", "write_incident"]
