"""What a save directory has published, in any format: the "latest" pointer and an iteration's
``metadata.json``, checked complete before anything reads it.

The pointer ``latest_checkpointed_iteration.txt`` (Megatron-LM's name) names the newest complete
iteration; ``iter_N/metadata.json`` exists only once every rank's files are in place, and lists
them (``shards``). How they are written: :mod:`hybrid.checkpoint.directory`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from hybrid.checkpoint.names import ITER_PATTERN, iteration_dir, list_iterations

POINTER = "latest_checkpointed_iteration.txt"

FOREIGN_HINT = ("to start from its weights, convert it to a Hugging Face checkpoint "
                "(Megatron-Bridge or Megatron-LM's tools/checkpoint) and pass that to "
                "--init-from-hf")
"""How another tool's checkpoint gets in, said with each refusal of one."""


class IncompleteCheckpointError(RuntimeError):
    """A checkpoint directory lacks its metadata or one of its files, or is in no format this
    code reads."""


def iteration_of_dir(path: str | os.PathLike) -> int | None:
    """The iteration N when ``path`` is one published ``iter_N`` directory (it has its
    ``metadata.json``) rather than a checkpoint root; None otherwise."""
    m = ITER_PATTERN.match(Path(path).name)
    return int(m.group(1)) if m and (Path(path) / "metadata.json").is_file() else None


def latest_iteration(root: str | os.PathLike) -> int | None:
    """The iteration the pointer names, or None when ``root`` has no published checkpoint."""
    pointer = Path(root) / POINTER
    if not pointer.is_file():
        return None
    text = pointer.read_text().strip()
    if text == "release":
        raise IncompleteCheckpointError(f"{pointer} says 'release': a checkpoint converted into "
                                        "Megatron-LM's legacy format (its release/ directory), "
                                        f"which this code does not read; {FOREIGN_HINT}")
    if not text.isdigit():
        raise IncompleteCheckpointError(f"{pointer} does not hold an iteration number: {text!r}")
    return int(text)


def chosen_iteration(root: str | os.PathLike, iteration: int | None) -> int:
    """``iteration``, or when None the latest complete one under ``root``.

    Raises:
        FileNotFoundError: no published checkpoint under ``root``; when ``root`` is one
            iteration's directory, the message names its root and ``--iteration``.
    """
    if iteration is not None:
        return iteration
    latest = latest_iteration(root)
    if latest is None:
        hint = ""
        if (n := iteration_of_dir(root)) is not None:
            hint = (f"; {root} is one iteration's directory: give the checkpoint root "
                    f"{Path(root).parent} and --iteration {n}")
        raise FileNotFoundError(f"no complete checkpoint under {root} (no "
                                f"{root}/latest_checkpointed_iteration.txt){hint}")
    return latest


def read_metadata(root: str | os.PathLike, iteration: int) -> dict:
    """``metadata.json`` of a published checkpoint, after checking every file it lists exists
    (which format it is, and whether it is readable: :func:`hybrid.checkpoint.registry.format_of`).

    Raises:
        IncompleteCheckpointError: no metadata (the save never finished) or a missing shard;
            the message says which and where.
        FileNotFoundError: no such iteration directory.
    """
    d = iteration_dir(root, iteration)
    if not d.is_dir():
        raise FileNotFoundError(f"no checkpoint for iteration {iteration} in {root} "
                                f"(available: {list_iterations(root)})")
    meta_path = d / "metadata.json"
    legacy = sorted(d.glob("mp_rank_*/model_optim_rng.pt"))
    if not meta_path.is_file() and legacy:
        raise IncompleteCheckpointError(f"{d}: a checkpoint in Megatron-LM's legacy format 'torch' "
                                        f"({legacy[0].relative_to(d)}), which this code does not "
                                        f"read; {FOREIGN_HINT}")
    if not meta_path.is_file():
        raise IncompleteCheckpointError(f"{d} has no metadata.json: the save did not finish; not "
                                        "loading it")
    meta = json.loads(meta_path.read_text())
    missing = [s for s in meta.get("shards", []) if not (d / s).is_file()]
    if missing:
        raise IncompleteCheckpointError(f"{d} is missing shards {missing}; not loading it")
    return meta
