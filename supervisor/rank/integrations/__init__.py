"""Framework integrations: the worker API for loops a framework owns (Hugging Face Trainer,
Lightning). Each module imports its framework; nothing else in babysit imports them, so babysit
without the ``hf``/``lightning`` extras never does. Users import them from
``babysit.integrations``."""
