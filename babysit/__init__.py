"""babysit: an automated babysitter for distributed PyTorch training.

A training script needs two names from here::

    from babysit import attach

    run = attach(model=model, optimizer=opt)
    for batch in run.batches(loader):
        ...
        run.step(loss=loss)

Everything else is the supervisor's side (``babysit run``), which a training script never
imports. The package's rooms, in the order a loss spike travels through them, are drawn in
``docs/architecture.md``.

``babysit.supervisor``, ``babysit.policies`` and ``babysit.checkpoints`` are the repository's
``supervisor/``, ``policies/`` and ``checkpoints/`` folders (linked here, so the wheel, an editable
install, ruff and mypy all see one package and nothing else at the top level).
"""

from babysit.supervisor.rank.api import Run, attach
from babysit.supervisor.rank.elastic_data import ElasticSampler

__all__ = ["ElasticSampler", "Run", "attach"]
