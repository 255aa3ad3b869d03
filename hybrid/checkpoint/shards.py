"""Save and load training checkpoints that any grid can read (exact resume and resharding).

Each rank writes one safetensors shard (``hybrid.checkpoint.directory`` handles directories,
atomicity and the "latest" pointer). A shard holds, per parameter name and kind (``master``,
``exp_avg``, ``exp_avg_sq``; fp32), one *fragment*: the tensor-parallel rank's local tensor
without vocabulary padding, flattened, cut into ``dp`` equal ranges; data-parallel rank ``d``
stores range ``d``. Its place in the full tensor follows from the parameter's TP spec, which
``metadata.json`` records (full shape, split dimension, padded size) together with the grid;
each shard also names its fragments' ranges in its own safetensors metadata. Loading assembles
each full tensor from the fragments of every source rank, one parameter at a time, and cuts
this rank's piece with the *target* TP spec, so a checkpoint saved at one (tp, dp, stage)
loads at any other. The 16/32-bit model weights are not stored: they are the master weights,
rounded. RNG states are stored per rank and restored only on the same grid.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from hybrid.checkpoint.directory import (
    latest_iteration,
    publish,
    read_metadata,
    shard_name,
    staging_dir,
)
from hybrid.checkpoint.weights import load_weights
from hybrid.parallel.layers import TPSpec, get_tp_spec
from hybrid.parallel.rng import capture_rng_states, restore_rng_states

KINDS = ("master", "exp_avg", "exp_avg_sq")


def _fragment_range(numel: int, dp: int, dp_rank: int) -> tuple[int, int]:
    return numel * dp_rank // dp, numel * (dp_rank + 1) // dp


def _real_local(t: torch.Tensor, spec: TPSpec) -> torch.Tensor:
    """Drop the vocabulary padding rows of a TP-local tensor."""
    return t if spec.replicated else t.narrow(spec.split_dim, 0, spec.real_local_size())


def _param_specs(engine) -> dict[str, TPSpec]:
    return {name: get_tp_spec(p) for name, p in engine.model.named_parameters()}


def save_checkpoint(root: str | os.PathLike, iteration: int, engine, grid, train_state: dict,
                    metadata: dict, tracker=None, keep: int | None = None) -> Path | None:
    """Write a checkpoint of ``iteration`` under ``root`` (collective: every rank calls).

    Args:
        root: ``--save`` directory.
        iteration: the completed iteration.
        engine: the :class:`hybrid.zero.engine.ZeroEngine`.
        grid: the process grid.
        train_state: JSON-able counters (iteration, consumed samples, schedule index, ...).
        metadata: JSON-able extras (config, tokenizer, model dims) for ``metadata.json``.
        tracker: the TP RNG tracker (its stream is saved with the other RNG states).
        keep: keep only the newest ``keep`` checkpoints (None keeps all).

    Returns:
        The published directory on rank 0, None elsewhere.
    """
    state = engine.optimizer_state_by_name()  # collective over dp
    specs = _param_specs(engine)
    stage_dir = staging_dir(root, iteration)
    if grid.rank == 0:
        stage_dir.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    tensors, layout = {}, {}
    for name, entry in state.items():
        spec = specs[name]
        for kind in KINDS:
            real = _real_local(entry[kind], spec).reshape(-1)
            lo, hi = _fragment_range(real.numel(), grid.dp_size, grid.dp_rank)
            tensors[f"{kind}/{name}"] = real[lo:hi].float().cpu().contiguous()
        layout[name] = dict(tp_rank=grid.tp_rank, local_shape=list(_real_local(entry["master"], spec).shape),
                            flat_range=[lo, hi])
    for key, value in capture_rng_states(tracker, grid.device).items():
        tensors[f"rng/{key}"] = value.cpu().contiguous()
    tmp = stage_dir / (shard_name(grid.rank) + ".partial")
    save_file(tensors, str(tmp), metadata={"layout": json.dumps(layout), "rank": str(grid.rank)})
    os.replace(tmp, stage_dir / shard_name(grid.rank))
    dist.barrier()
    final = None
    if grid.rank == 0:
        params = {name: dict(full_shape=list(s.full_shape), split_dim=s.split_dim, padded_size=s.padded_size)
                  for name, s in specs.items()}
        meta = dict(metadata, grid=dict(tp=grid.tp_size, dp=grid.dp_size, world_size=grid.world_size),
                    zero_stage=engine.stage, train_state=train_state, loss_scaler=engine.scaler.state_dict(),
                    optimizer_step=int(next(iter(state.values()))["step"]), params=params)
        final = publish(root, iteration, meta, grid.world_size, keep)
    dist.barrier()
    return final


class CheckpointReader:
    """Reads full (unsharded) tensors out of a published checkpoint, whatever its grid.

    Args:
        root: the checkpoint root (``--load``).
        iteration: which iteration (default: the latest complete one).

    Raises:
        FileNotFoundError: no published checkpoint under ``root``.
        hybrid.checkpoint.directory.IncompleteCheckpointError: metadata or a shard is missing.
    """

    def __init__(self, root: str | os.PathLike, iteration: int | None = None):
        if iteration is None:
            iteration = latest_iteration(root)
            if iteration is None:
                raise FileNotFoundError(f"no complete checkpoint under {root} (no {root}/latest_checkpointed_iteration.txt)")
        self.root, self.iteration = Path(root), iteration
        self.meta = read_metadata(root, iteration)
        d = self.root / f"iter_{iteration:07d}"
        self._files = [safe_open(str(d / s), framework="pt") for s in self.meta["shards"]]
        self._layouts = [json.loads(f.metadata()["layout"]) for f in self._files]
        g = self.meta["grid"]
        self.tp, self.dp = g["tp"], g["dp"]

    def full_tensor(self, name: str, kind: str = "master") -> torch.Tensor:
        """The full unpadded fp32 tensor of parameter ``name`` (``kind`` in :data:`KINDS`)."""
        p = self.meta["params"][name]
        full = torch.empty(p["full_shape"], dtype=torch.float32)
        split, per = p["split_dim"], (p["padded_size"] // self.tp if p["split_dim"] is not None else 0)
        for t in range(self.tp if split is not None else 1):
            frags, shape = [], None
            for d in range(self.dp):
                r = t + self.tp * d
                frags.append(self._files[r].get_tensor(f"{kind}/{name}"))
                shape = self._layouts[r][name]["local_shape"]
            local = torch.cat(frags).view(shape)
            if split is None:
                full.copy_(local)
            elif local.shape[split] > 0:
                full.narrow(split, t * per, local.shape[split]).copy_(local)
        return full

    def param_names(self) -> list[str]:
        return list(self.meta["params"])

    def rng_states(self, rank: int) -> dict[str, torch.Tensor]:
        f = self._files[rank]
        return {k[4:]: f.get_tensor(k) for k in f.keys() if k.startswith("rng/")}


def load_checkpoint(root: str | os.PathLike, engine, grid, tracker=None, load_optim: bool = True,
                    load_rng: bool = True) -> dict:
    """Load the latest complete checkpoint under ``root`` into ``engine`` (collective).

    With ``load_optim=False`` only the weights come back (fresh Adam moments, step 0). RNG
    states come back only when ``load_rng`` and the grid equals the saved one.

    Returns:
        ``metadata.json`` of the loaded checkpoint (its ``train_state`` restores the loop).
    """
    reader = CheckpointReader(root)
    specs = _param_specs(engine)
    saved, ours = set(reader.param_names()), set(specs)
    if saved != ours:
        raise KeyError(f"checkpoint {reader.root} does not match the model: missing {sorted(ours - saved)}, "
                       f"unexpected {sorted(saved - ours)}")
    if load_optim:
        step = torch.tensor(float(reader.meta["optimizer_step"]))
        engine.load_optimizer_state_by_name({
            name: dict({kind: spec.shard(reader.full_tensor(name, kind)) for kind in KINDS}, step=step)
            for name, spec in specs.items()})
        engine.scaler.load_state_dict(reader.meta["loss_scaler"])
    else:  # weights only (--finetune, --no-load-optim): the path --init-from-hf shares
        load_weights(engine, lambda name: reader.full_tensor(name, "master"))
    same_grid = (reader.tp, reader.dp) == (grid.tp_size, grid.dp_size)
    if load_rng and same_grid:
        restore_rng_states(reader.rng_states(grid.rank), tracker, grid.device)
    elif load_rng and grid.rank == 0:
        warnings.warn(f"checkpoint grid tp={reader.tp} x dp={reader.dp} differs from this run's "
                      f"tp={grid.tp_size} x dp={grid.dp_size}: RNG states are not restored", stacklevel=2)
    return reader.meta
