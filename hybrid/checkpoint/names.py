"""Names of a save directory's entries: ``iter_NNNNNNN`` (one published checkpoint)."""

from __future__ import annotations

import os
import re
from pathlib import Path

ITER_PATTERN = re.compile(r"^iter_(\d{7,})$")


def iteration_dir(root: str | os.PathLike, iteration: int) -> Path:
    """``root/iter_{iteration:07d}``."""
    return Path(root) / f"iter_{iteration:07d}"


def list_iterations(root: str | os.PathLike) -> list[int]:
    """Iterations with a published directory under ``root``, ascending (complete or not)."""
    p = Path(root)
    if not p.is_dir():
        return []
    return sorted(int(m.group(1)) for d in p.iterdir()
                  if d.is_dir() and (m := ITER_PATTERN.match(d.name)))
