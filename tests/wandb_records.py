"""Read back what wandb wrote: the records of a run's ``.wandb`` file, decoded with wandb's own
protobuf classes.

wandb 0.31 has no public reader of an offline run. Its ``.wandb`` file is the run's transaction
log, written by wandb's own service: a 7-byte header (``:W&B``, magic 0xBEE1, version 0), then
32 KiB blocks (counted from the file's start) of LevelDB-log chunks, each a 7-byte header (CRC-32
of the type byte and the data, length, type: 1 full, 2 first, 3 middle, 4 last) and its data; a
block's tail too short for a header is padding. The chunks of one record join into a serialized
``wandb_internal_pb2.Record``. Every CRC is checked: a misread file fails, never reads short.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from wandb.proto import wandb_internal_pb2

HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
BLOCK = 32 * 1024
CHUNK = struct.Struct("<IHB")
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def payloads(data: bytes) -> Iterator[bytes]:
    assert data[:len(HEADER)] == HEADER, "not a .wandb file"
    pos, parts = len(HEADER), b""
    while pos + CHUNK.size <= len(data):
        if BLOCK - pos % BLOCK < CHUNK.size:  # padding at a block's end
            pos += BLOCK - pos % BLOCK
            continue
        crc, length, kind = CHUNK.unpack_from(data, pos)
        if kind == 0 and length == 0:  # zeros: the end of what was written
            return
        body = data[pos + CHUNK.size:pos + CHUNK.size + length]
        assert zlib.crc32(bytes([kind]) + body) == crc, f"bad CRC at byte {pos}"
        pos += CHUNK.size + length
        if kind == FULL:
            yield body
        elif kind == FIRST:
            parts = body
        elif kind == MIDDLE:
            parts += body
        elif kind == LAST:
            yield parts + body
        else:
            raise AssertionError(f"chunk type {kind} at byte {pos}")


def records(path: Path) -> Iterator[wandb_internal_pb2.Record]:
    for payload in payloads(path.read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        yield record


def history(path: Path) -> list[dict[str, Any]]:
    """Every ``run.log()`` of the run, in order: key to its JSON-decoded value (a media
    value, such as a table, as the dict wandb logged for it)."""
    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") != "history":
            continue
        row: dict[str, Any] = {}
        for item in record.history.item:
            *outer, key = [item.key] if item.key else list(item.nested_key)
            into = row
            for name in outer:
                into = into.setdefault(name, {})
            into[key] = json.loads(item.value_json)
        rows.append(row)
    return rows


def run_file(folder: Path) -> Path:
    """The one ``.wandb`` file of the one run wandb wrote under ``folder``."""
    (path,) = folder.glob("wandb/*run-*/run-*.wandb")
    return path


def own_dirs(folder: Path, env: dict[str, str]) -> dict[str, str]:
    """``env`` with wandb's cache, data and config folders under ``folder``, so that a test
    leaves nothing in the home directory."""
    return {**env, **{f"WANDB_{kind}_DIR": str(folder / f"wandb-{kind.lower()}")
                      for kind in ("CACHE", "DATA", "CONFIG")}}
