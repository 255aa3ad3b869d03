"""A second checkpoint format that exists only in the tests (tests/test_checkpoint_format.py):
the proof that a format is one module behind the door (:mod:`hybrid.checkpoint.format`), with
nothing of the job, the async saver or consolidation changed for it.

``plain_test``: each rank writes one safetensors file (``safetensors.torch.save_file``, none of
the default format's code) holding, for every fragment it owns, the three fp32 states over its
range of the *padded* TP-local tensor, keyed ``{kind}/{name}/{tp_rank}/{start}``, and its RNG
states; no layout header. Its reader assembles each parameter's TP-local tensors from the
pieces, concatenates them and cuts the padding: whole tensors for consolidation, any rank's
range of any grid for a resume.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hybrid.checkpoint.format import CheckpointFormat, RankPart
from hybrid.checkpoint.names import iteration_dir
from hybrid.checkpoint.registry import FORMATS, register_format
from hybrid.checkpoint.stream import Entry
from hybrid.zero import state
from hybrid.zero.state import KINDS


class PlainReader:
    """A ``plain_test`` checkpoint (a :class:`hybrid.checkpoint.format.Reader`)."""

    def __init__(self, root: Path, iteration: int, meta: dict):
        self.root, self.iteration, self.meta = Path(root), iteration, meta
        self.bytes_read = self.reads = 0
        d = iteration_dir(root, iteration)
        self.files = [safe_open(str(d / f), framework="pt") for f in meta["shards"]]
        self.pieces: dict[tuple[str, int], list[tuple[int, int]]] = {}
        for i, f in enumerate(self.files):
            for key in f.keys():
                kind, _, rest = key.partition("/")
                if kind == "master":
                    name, t, start = rest.split("/")
                    self.pieces.setdefault((name, int(t)), []).append((int(start), i))

    def full_tensor(self, name: str, kind: str = "master") -> torch.Tensor:
        p = self.meta["params"][name]
        full, split = list(p["full_shape"]), p["split_dim"]
        tp = self.meta["grid"]["tp"] if split is not None else 1
        local = list(full)
        if split is not None:
            local[split] = p["padded_size"] // tp
        parts = []
        for t in range(tp):
            flat = torch.zeros(torch.Size(local).numel())
            for start, i in self.pieces[(name, t)]:
                data = self.files[i].get_tensor(f"{kind}/{name}/{t}/{start}")
                flat[start:start + data.numel()] = data
                self.bytes_read, self.reads = self.bytes_read + 4 * data.numel(), self.reads + 1
            parts.append(flat.view(local))
        if split is None:
            return parts[0]
        return torch.cat(parts, split).narrow(split, 0, full[split]).contiguous()

    def read_local(self, name, kind, spec, start, stop, out) -> None:
        out.copy_(spec.shard(self.full_tensor(name, kind)).reshape(-1)[start:stop])

    def rng_states(self, rank: int) -> dict[str, torch.Tensor]:
        f = self.files[rank]
        return {k[4:]: f.get_tensor(k) for k in f.keys() if k.startswith("rng/")}


class PlainFormat(CheckpointFormat):
    name = "plain_test"
    description = "a test's format: padded fragments, one file per rank"

    def part(self, engine, grid, rng) -> RankPart:
        entries = []
        for f in state.owned_state(engine):
            if f.spec.replicated and grid.tp_rank != 0:
                continue
            entries += [Entry(f"{k}/{f.slot.name}/{grid.tp_rank}/{f.start}", torch.float32,
                              (f.stop - f.start,), lambda v=f.views[k]: v) for k in KINDS]
        entries += [Entry(f"rng/{k}", v.dtype, tuple(v.shape), lambda v=v: v)
                    for k, v in rng.items()]
        return RankPart(entries, {})

    def write(self, stage_dir: Path, rank: int, part: RankPart) -> None:
        tmp = stage_dir / f"plain_{rank}.partial"
        save_file({e.key: e.produce().detach().cpu().contiguous() for e in part.entries}, tmp)
        os.replace(tmp, stage_dir / f"plain_{rank}.safetensors")

    def files(self, world_size: int) -> list[str]:
        return [f"plain_{r}.safetensors" for r in range(world_size)]

    def reader(self, root: Path, iteration: int, meta: dict) -> PlainReader:
        return PlainReader(root, iteration, meta)


PLAIN = PlainFormat()


def register_plain() -> None:
    """Make ``--ckpt-format plain_test`` known in this process (once)."""
    if FORMATS.get(PLAIN.name) is not PLAIN:
        register_format(PLAIN)


def plain_world(rank: int, world: int, argvs: list[list[str]]) -> list[list[dict]]:
    """:func:`tests.pretrain_worlds.run_configs` with ``plain_test`` registered in each rank."""
    from tests.pretrain_worlds import run_configs

    register_plain()
    return run_configs(rank, world, argvs)
