"""babysit's supervisor process, and the worker API that training scripts import from it.

Training scripts use only ``attach`` (see ``supervisor.worker``); everything else here is the
supervisor side, which never imports torch.
"""

from supervisor.worker import Run, attach

__all__ = ["Run", "attach"]
