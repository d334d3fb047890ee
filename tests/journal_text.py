"""What a journal entry must never hold: a number standing for "none", or a message a person
cannot read as a sentence. Used by the unit tests of the messages and by the e2e runs that read a
whole journal (docs/running.md, "The journal")."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

SENTINEL = 2**40
"""No step, count, size or pid of a run reaches it (a checkpoint of a TiB is 2**40 bytes): a
number this large stands for "no bound"."""
TEXT_FIELDS = frozenset({"reason", "summary", "title", "why", "message"})
"""The fields a person reads as sentences."""
_PROBLEMS = (
    (re.compile(r"\bNone\b"), "a None"),
    (re.compile(r"\b(ranks?|steps?|nodes?|batch(es)?) \[\d"), "a Python list"),
    (re.compile(r"\b(\w+) \1\b"), "a doubled word"),
    (re.compile(r"\d{13,}"), "a sentinel number"),
)


def unreadable(text: str) -> list[str]:
    """What keeps ``text`` from reading as a sentence: a None, a Python list of numbers, a
    doubled word, a sentinel number; [] when nothing does."""
    return [f"{what} in {text!r}" for pattern, what in _PROBLEMS if pattern.search(text)]


def problems(entries: Iterable[dict[str, Any]]) -> list[str]:
    """Every sentinel value (a huge number, a negative one other than an exit code's: a process
    killed by signal N exits -N) and every unreadable message in ``entries``, with the entry's
    event and the field's path. A message may quote another program's error (torch's
    ``dict_keys([0, 1])``): only babysit's own ways of going wrong are looked for."""
    found: list[str] = []

    def walk(value: Any, where: str, key: str) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{where}.{k}", str(k))
        elif isinstance(value, list):
            for i, v in enumerate(value):
                walk(v, f"{where}[{i}]", key)
        elif isinstance(value, bool):
            return
        elif isinstance(value, int):
            exit_code = "code" in where or "exit" in where
            if abs(value) >= SENTINEL or (value < 0 and not exit_code):
                found.append(f"{where} = {value}")
        elif isinstance(value, str) and key in TEXT_FIELDS:
            found.extend(f"{where}: {p}" for p in unreadable(value))

    for entry in entries:
        walk(entry, str(entry.get("event")), "")
    return found
