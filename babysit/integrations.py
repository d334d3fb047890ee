"""babysit for loops a framework owns, one line each in the training script::

    from babysit.integrations import hf_train
    hf_train(trainer)                                  # instead of trainer.train()

    from babysit.integrations import lightning_fit
    lightning_fit(trainer, model, datamodule=dm)       # instead of trainer.fit(model, ...)

Each name imports its framework only when used (``pip install 'babysit[hf]'`` or
``'babysit[lightning]'``); ``import babysit`` never does.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_WHERE = {
    "BabysitTrainerCallback": "hf", "hf_train": "hf",
    "BabysitLightningCallback": "lightning", "lightning_fit": "lightning",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'babysit.integrations' has no attribute {name!r}")
    module = import_module(f"babysit.supervisor.rank.integrations.{_WHERE[name]}")
    return getattr(module, name)
