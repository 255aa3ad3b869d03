"""Tensor-parallel weights: the full (single-process) parameters of a ``models.gpt.GPT`` and
their shards, in both directions, one parameter at a time.

- Into the shards: :func:`seeded_shard` / :func:`seeded_weights` draw each shard as the matching
  slice of ``GPT.init_weights(seed)`` (any tp gives the same weights), never holding more than
  :data:`SEED_CHUNK_ELEMENTS` of a parameter beyond the shard; :func:`full_weights` and
  :func:`load_full_state_dict` shard a full state dict; :func:`fill_weights` is what
  :func:`hybrid.parallel.tp_plan.parallelize_gpt` calls after its module swap.
- Out of them: :func:`gather_full_tensor` / :func:`gather_full_state_dict` all-gather the full
  tensors over the TP group (checkpoint resharding and the tests' comparisons).

Each parameter's :class:`hybrid.parallel.tp_spec.TPSpec` says how it is split.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn

from hybrid.parallel.tp_spec import TPSpec, get_tp_spec, set_tp_spec
from models.gpt import GPT, draws_normal, init_parameter, parameter_generator


def fill_weights(model: GPT, tp_group, full: dict | None, seed: int | None,
                 device: torch.device) -> None:
    """Give every remaining parameter a replicated ``tp_spec``, then shard ``full`` into the
    model or initialise it from ``seed`` (a meta model stays meta with neither)."""
    rank, tp = dist.get_rank(tp_group), dist.get_world_size(tp_group)
    for p in model.parameters():
        if getattr(p, "tp_spec", None) is None:
            set_tp_spec(p, TPSpec(None, tuple(p.shape), 0, rank, tp))
    if full is not None:
        load_full_state_dict(model, full)
    elif seed is not None:
        if any(p.is_meta for p in model.parameters()):
            model.to_empty(device=device)
        init_sharded(model, seed)


@torch.no_grad()
def init_sharded(model: GPT, seed: int) -> None:
    """Initialise each local shard as the matching slice of ``GPT.init_weights(seed)``.

    Materialises one full parameter at a time on CPU (the largest is the embedding).
    """
    weights = seeded_weights(model.config, seed)
    for name, p in model.named_parameters():
        p.copy_(weights(name, p))


# Elements drawn at once when a seeded shard is drawn row block by row block (16M fp32 = 64 MiB).
SEED_CHUNK_ELEMENTS = 1 << 24


def seeded_shard(name: str, spec: TPSpec, config, seed: int,
                 chunk_elements: int = SEED_CHUNK_ELEMENTS) -> torch.Tensor:
    """This TP rank's (zero-padded) shard of parameter ``name`` exactly as
    ``GPT.init_weights(seed)`` draws the full parameter, holding one block of rows at a time.

    The full ``[rows, cols]`` weight is drawn from its own generator in consecutive blocks of a
    multiple of 16 rows (at most ``chunk_elements`` elements, except that a block is at least
    16 rows); each block keeps the part of this rank's shard it holds, and drawing stops after
    the shard's last row. Torch's CPU ``normal_`` draws one uniform per element in order and
    transforms aligned groups of 16 (Box-Muller; a tensor whose size is not a multiple of 16
    redraws its last 16), so blocks that start on a multiple of 16 elements and a last block of
    at least 16 elements give exactly the values of one full draw (checked for every shape
    kind by ``tests/test_tp_seeded_init.py``). Peak: one block plus the shard, instead of the
    full parameter (1.6 GB for the 100B model's embedding at tp 8).

    Args:
        name: parameter name in the plain GPT (decides the init, as ``init_parameter``).
        spec: the parameter's :class:`TPSpec` on this rank.
        config: the ``GPTConfig``.
        seed: the job seed of ``GPT.init_weights(seed)``.
        chunk_elements: elements per block (tests make it small).

    Returns:
        fp32 CPU tensor of this rank's local (padded) shape.
    """
    full_shape = spec.full_shape
    numel = math.prod(full_shape)
    if spec.replicated or not draws_normal(name) or len(full_shape) != 2 or numel < 32:
        full = torch.empty(full_shape)
        init_parameter(name, full, config, parameter_generator(seed, name))
        return spec.shard(full)
    rows, cols = full_shape
    start, stop = spec.local_range()
    real = spec.real_local_size()
    shape = list(full_shape)
    shape[spec.split_dim] = stop - start
    out = torch.zeros(shape)
    block = max(16, chunk_elements // cols // 16 * 16)
    bounds = list(range(0, rows, block)) + [rows]
    if len(bounds) > 2 and (rows - bounds[-2]) * cols < 16:  # a last block under 16 elements
        bounds.pop(-2)                                     # draws differently: merge it
    last_row = start + real if spec.split_dim == 0 else rows
    gen = parameter_generator(seed, name)
    for r0, r1 in zip(bounds[:-1], bounds[1:], strict=True):
        if r0 >= last_row:
            break
        part = torch.empty(r1 - r0, cols)
        init_parameter(name, part, config, gen)
        if spec.split_dim == 1:
            out[r0:r1, :real] = part[:, start:start + real]
        else:
            lo, hi = max(r0, start), min(r1, start + real)
            if lo < hi:
                out[lo - start:hi - start] = part[lo - r0:hi - r0]
    return out


def seeded_weights(config, seed: int):
    """A weight source (:mod:`hybrid.zero.storage`): ``(name, param) -> `` this TP rank's shard
    of parameter ``name`` exactly as ``GPT.init_weights(seed)`` initialises the full model
    (fp32, on CPU; drawn block by block, :func:`seeded_shard`)."""
    def source(name: str, param: torch.Tensor) -> torch.Tensor:
        return seeded_shard(name, get_tp_spec(param), config, seed)

    return source


def full_weights(state_dict: dict[str, torch.Tensor]):
    """A weight source slicing this TP rank's shard out of full (single-process) tensors.

    Raises (when called):
        KeyError: the name is missing from ``state_dict``.
        ValueError: the full tensor's shape differs from ``param.tp_spec.full_shape``.
    """
    def source(name: str, param: torch.Tensor) -> torch.Tensor:
        if name not in state_dict:
            raise KeyError(f"{name} is missing from the weights (have {len(state_dict)} tensors)")
        try:
            return get_tp_spec(param).shard(state_dict[name].float())
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None

    return source


@torch.no_grad()
def load_full_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Copy full (unsharded, unpadded) tensors into ``model``'s local shards.

    Raises:
        KeyError: a parameter of ``model`` is missing from ``state_dict``, or the dict has keys
            the model does not know (both listed).
        ValueError: a tensor's shape differs from the parameter's full shape.
    """
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(params))
    if missing or unexpected:
        raise KeyError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    for name, p in params.items():
        spec = get_tp_spec(p)
        try:
            p.copy_(spec.shard(state_dict[name].to(p.device, p.dtype)))
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None


@torch.no_grad()
def gather_full_tensor(local: torch.Tensor, spec: TPSpec, group) -> torch.Tensor:
    """All-gather a sharded tensor over the TP group and drop its padding -> ``spec.full_shape``."""
    if spec.replicated or spec.tp_size == 1:
        return local.detach().clone() if spec.replicated else local.detach().narrow(
            spec.split_dim, 0, spec.full_shape[spec.split_dim]).clone()
    parts = [torch.empty_like(local) for _ in range(spec.tp_size)]
    dist.all_gather(parts, local.detach().contiguous(), group=group)
    return torch.cat(parts, dim=spec.split_dim).narrow(
        spec.split_dim, 0, spec.full_shape[spec.split_dim]).clone()


def gather_full_state_dict(model: nn.Module, tp_group,
                           tensors: dict[str, torch.Tensor] | None = None
                           ) -> dict[str, torch.Tensor]:
    """The full (single-process) state dict of a TP model, identical on every TP rank.

    Args:
        model: a model made by :func:`parallelize_gpt`.
        tp_group: its tensor-parallel group.
        tensors: optional per-parameter local tensors to gather instead of the parameters
            themselves (e.g. their ``.grad``), keyed like ``model.named_parameters()``.

    Returns:
        ``{name: tensor of spec.full_shape}`` on the parameters' device.
    """
    out = {}
    for name, p in model.named_parameters():
        local = p if tensors is None else tensors[name]
        out[name] = gather_full_tensor(local, get_tp_spec(p), tp_group)
    return out


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """``(sharded, replicated)``: real (unpadded) elements of this rank's split parameters, and
    elements of its replicated ones. Summing ``sharded`` over TP ranks and adding ``replicated``
    once gives the single-process count."""
    sharded = replicated = 0
    for p in model.parameters():
        spec = get_tp_spec(p)
        if spec.replicated:
            replicated += p.numel()
        else:
            sharded += spec.real_numel()
    return sharded, replicated
