"""What runs inside a training rank: the worker API (``attach``), saving, SDC fingerprints.

Imported by training scripts: nothing here may import the supervisor's own dependencies
(pydantic, matplotlib, requests) at module level, and torch only where a rank needs it.
"""
