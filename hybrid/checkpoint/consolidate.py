"""Write one fp32 state dict (safetensors) from a distributed checkpoint, for the plain GPT.

``python -m hybrid.consolidate --load DIR [--iteration N] --output model.safetensors``

The result loads with ``strict=True`` into ``models.gpt.GPT`` built from the checkpoint's model
dimensions (``metadata.json``), the tied embedding included (stored once as ``wte.weight``).
The checkpoint is read in the format its ``metadata.json`` names
(:func:`hybrid.checkpoint.registry.open_checkpoint`), in one process, whatever grid saved it,
one tensor at a time: each full tensor is assembled by the format's reader, written and freed
before the next, so the peak is the largest tensor plus what the reader stages (the default
format: its read chunk, ``hybrid.checkpoint.fragments.READ_CHUNK``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from hybrid.checkpoint.published import IncompleteCheckpointError
from hybrid.checkpoint.registry import open_checkpoint
from hybrid.checkpoint.stream import Entry, write_safetensors


def consolidate(load: str, output: str, iteration: int | None = None) -> dict:
    """Assemble every parameter's full fp32 master weight and write them to ``output``.

    Returns:
        The checkpoint's ``metadata.json`` (its ``model`` entry gives the GPTConfig fields).

    Raises:
        FileExistsError: ``output`` already exists (nothing is overwritten; checked before any
            read).
        FileNotFoundError / IncompleteCheckpointError: no complete checkpoint to read.
    """
    out = Path(output)
    if out.exists() or out.is_symlink():
        raise FileExistsError(f"--output {out} already exists; give a new file name (nothing is "
                              "overwritten)")
    reader = open_checkpoint(load, iteration)
    entries = [Entry(name, torch.float32, tuple(p["full_shape"]),
                     lambda name=name: reader.full_tensor(name, "master"))
               for name, p in reader.meta["params"].items()]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".partial")
    write_safetensors(tmp, entries, metadata={"iteration": str(reader.iteration),
                                              "model": json.dumps(reader.meta.get("model", {}))})
    os.replace(tmp, out)
    return reader.meta


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m hybrid.consolidate",
                                description=__doc__.split("\n")[0])
    p.add_argument("--load", required=True, help="checkpoint directory (the --save of the run)")
    p.add_argument("--iteration", type=int,
                   help="which iteration (default: the latest complete one)")
    p.add_argument("--output", required=True, help="output .safetensors file")
    args = p.parse_args(argv)
    try:
        meta = consolidate(args.load, args.output, args.iteration)
    except (FileExistsError, FileNotFoundError, IncompleteCheckpointError) as e:
        print(f"consolidate: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}: {len(meta['params'])} tensors from iteration {meta['iteration']} "
          f"(saved at tp={meta['grid']['tp']} x dp={meta['grid']['dp']}, ZeRO stage "
          f"{meta['zero_stage']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
