"""Files a tool writes at its end, checked before it starts, so that a long run is not lost to a path it cannot use."""

from __future__ import annotations

from pathlib import Path


def unwritable(paths: list[Path]) -> str | None:
    """Why one of `paths` cannot be written, or None where each can: their folders are made, each file opened for
    writing (and removed again where it was not there before). Root passes permission bits, so only writing tells."""
    for path in paths:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            existed = path.exists()
            with path.open("ab"):
                pass
            if not existed:
                path.unlink()
        except OSError as exc:
            return f"cannot write {path}: {exc.strerror or exc}"
    return None
