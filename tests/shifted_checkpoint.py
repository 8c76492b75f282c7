"""A stopped query's checkpoint made to look as it would after months of batches: every batch
id moved up by the same amount, in every file Spark numbers by batch (``offsets/N``,
``commits/N``, the file source's log ``sources/<i>/N`` and ``N.compact`` with the ids inside,
the ``logOffset`` each offsets file points at, and the state store's versions ``N.zip``,
``N.changelog``, ``N.delta``, ``N.snapshot``). Spark restarts on it and goes on numbering
from there, as it does for a query that has run that long.

The amount must keep the file source log's compaction points (every tenth entry), so a
multiple of 10; Hadoop's checksum files (``.N.crc``) are dropped (Spark reads a file without
one; a stale one would fail the read).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

_NUMBERED = re.compile(
    r"^(\d+)((?:_[0-9A-Za-z-]+)?(?:\.(?:compact|zip|changelog|delta|snapshot))?)$"
)


def shift_checkpoint(root: Path, by: int) -> None:
    """Move every batch id of the checkpoint at ``root`` up by ``by`` (in place)."""
    if by % 10:
        raise ValueError("shift by a multiple of 10: the source log compacts every 10 entries")
    for crc in root.rglob(".*.crc"):
        crc.unlink()
    for folder in ("offsets", "commits"):
        _rename_numbered(root / folder, by, _shift_offsets if folder == "offsets" else None)
    for source in sorted((root / "sources").glob("*")):
        _rename_numbered(source, by, _shift_source_log)
    for store in sorted((root / "state").glob("*/*")) if (root / "state").exists() else []:
        if store.is_dir() and store.name.isdigit():
            _rename_numbered(store, by, None)
            for sub in store.iterdir():  # stores of a join, one folder each
                if sub.is_dir() and not sub.name.isdigit():
                    _rename_numbered(sub, by, None)


def _rename_numbered(folder: Path, by: int, rewrite: object) -> None:
    if not folder.is_dir():
        return
    named = [(p, m) for p in folder.iterdir() if p.is_file() and (m := _NUMBERED.match(p.name))]
    # highest first, so a new name never meets an old one
    for path, match in sorted(named, key=lambda pm: -int(pm[1].group(1))):
        target = folder / f"{int(match.group(1)) + by}{match.group(2)}"
        if callable(rewrite):
            target.write_text(rewrite(path.read_text(), by))
            path.unlink()
        else:
            path.rename(target)


def _shift_offsets(text: str, by: int) -> str:
    """A file source's ``{"logOffset": K}`` line points at its log entry K, moved too."""
    lines = text.split("\n")
    for i, line in enumerate(lines[2:], start=2):
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict) and isinstance(doc.get("logOffset"), int):
            lines[i] = json.dumps({**doc, "logOffset": doc["logOffset"] + by})
    return "\n".join(lines)


def _shift_source_log(text: str, by: int) -> str:
    lines = text.split("\n")
    out = [lines[0]]
    for line in lines[1:]:
        if line.strip():
            doc = json.loads(line)
            doc["batchId"] = int(doc["batchId"]) + by
            line = json.dumps(doc)
        out.append(line)
    return "\n".join(out)
