"""What a ZeRO engine holds, in bytes and tensors, and a printable account of it (ZeRO paper §5
model states, §6.2 constant-size buffers; arXiv 1910.02054). Read by the start-up line, the dry
run's memory meter and the planner's cross-check."""

from __future__ import annotations

import torch

from hybrid.zero.offload import SplitFlat


def _nb(t) -> int:
    """Device bytes of a tensor, or of an offloaded :class:`hybrid.zero.offload.SplitFlat`."""
    if t is None:
        return 0
    if isinstance(t, SplitFlat):
        return t.device_bytes
    return t.numel() * t.element_size()


def _host(t) -> int:
    return t.host_bytes if isinstance(t, SplitFlat) else 0


def _secondary(engine) -> torch.Tensor | None:
    sec = engine.gatherer.secondary if engine.gatherer is not None else None
    return None if sec is None else sec.buffer


def memory_bytes(engine) -> dict[str, int]:
    """Bytes held by this rank: ``params`` (compute-dtype parameter storage: the full flat
    buffer, or for stage 3 the shard plus persistent units and hpZ's secondary shard),
    ``grads`` (the gradient accumulation buffer: fp32, or bf16 with ``--grad-reduce-in-bf16``),
    ``master`` (fp32 weights the optimizer updates), ``optimizer`` (Adam moments), ``buffers``
    (communication staging, allocated once), ``gathered_peak`` (stage 3: most bytes of gathered
    units alive at once so far). With ``--optimizer-cpu-offload``, ``master`` and ``optimizer``
    count the device-kept part only and ``host_states`` the host memory: the offloaded master
    and moments plus the host gradient copy (0 without offload)."""
    st, plan = engine.states, engine.plan
    if not plan.shards_parameters:
        params = _nb(st.param_flat)
    else:
        params = _nb(st.param_shard) + sum(
            _nb(st.unit_bufs[u.index]) for u in engine.layout.units if u.persistent)
        params += _nb(_secondary(engine))
    return dict(params=params, grads=_nb(engine.reducer.buffer), master=_nb(st.master),
                optimizer=_nb(st.exp_avg) + _nb(st.exp_avg_sq),
                buffers=engine.reducer.staging_bytes() + _nb(engine.ag_staging),
                gathered_peak=engine.gatherer.peak_bytes if engine.gatherer else 0,
                host_states=_host(st.master) + _host(st.exp_avg) + _host(st.exp_avg_sq)
                + (_nb(engine.host_grads.buf) if engine.host_grads is not None else 0))


def held_tensors(engine) -> list[torch.Tensor]:
    """Every long-lived tensor this rank allocated: the model states, the gradient buffer,
    the compute-dtype parameters (stage 3: shard and persistent units) and the staging
    buffers (for memory meters such as ``hybrid.dryrun.dry_run``); with offload also the
    host-memory ones (``memory_bytes()["host_states"]`` of them)."""
    st = engine.states
    out = [t for s in (st.master, st.exp_avg, st.exp_avg_sq)
           for t in (s.parts() if isinstance(s, SplitFlat) else [s])]
    out.append(engine.reducer.buffer)
    if engine.host_grads is not None:
        out.append(engine.host_grads.buf)
    out += [st.param_flat] if st.param_flat is not None else [st.param_shard]
    if engine.plan.shards_parameters:
        out += [st.unit_bufs[u.index] for u in engine.layout.units if u.persistent]
        out += [t for t in (_secondary(engine),) if t is not None]
    out += [t for pair in engine.reducer.staging for t in pair if t.numel()]
    if engine.ag_staging is not None:
        out.append(engine.ag_staging)
    return out


def summary(engine) -> str:
    """A printable account: layout, bytes held per kind, last iteration's traffic."""
    mib = {k: f"{v / 2**20:.2f} MiB" for k, v in memory_bytes(engine).items()}
    traffic = {k: f"{v / 2**20:.2f} MiB" for k, v in engine.last_comm_bytes.items()}
    return (f"ZeRO stage {engine.stage} {engine.config.precision} dp={engine.dp} "
            f"rank={engine.dp_rank}: {engine.layout}\n  held: {mib}\n  moved last step: {traffic}")
