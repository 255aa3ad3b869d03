"""What a ZeRO engine holds, in bytes and tensors, and a printable account of it (ZeRO paper §5
model states, §6.2 constant-size buffers; arXiv 1910.02054). Read by the start-up line, the dry
run's memory meter and the planner's cross-check. The start-up line itself is here too
(:func:`engine_line`): the stage, what the gradient and parameter paths do
(:func:`engine_modes`) and the bytes held, so the job only prints it."""

from __future__ import annotations

import torch

from hybrid.zero.offload import SplitFlat
from hybrid.zero.reduce import fusion_words


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


def engine_line(engine) -> str:
    """The engine's start-up line, which the job prints on rank 0: ZeRO stage, precision, what
    the gradient and parameter paths do (:func:`engine_modes`) and this rank's bytes held per
    kind (MiB); on stage 3 also how many parameters ``--param-persistence-threshold`` keeps
    whole, and when that is all of them, which flag value partitions them."""
    held = ", ".join(f"{k} {v / 2**20:.2f}" for k, v in engine.memory_bytes().items() if v)
    config, layout = engine.config, engine.layout
    kept = [u for u in layout.units if u.persistent] if engine.plan.shards_parameters else []
    note = ""
    if kept:  # otherwise stage 3's "params" looks unpartitioned on a small model
        n = sum(u.numel for u in kept)
        note = (f" (params: the shard plus {n:,} of {layout.numel:,} parameters kept whole, "
                f"those under --param-persistence-threshold "
                f"{config.param_persistence_threshold:,}")
        if n == layout.numel:  # stage 3 then saves no parameter memory: say how to change it
            note += ("; so none is partitioned: a smaller --param-persistence-threshold "
                     "partitions the larger ones, 0 partitions all")
        note += ")"
    return (f"ZeRO stage {engine.stage} {config.precision} over dp {engine.dp} | "
            f"{engine_modes(config, engine.grid.device, engine.dp)} | MiB held on rank 0: "
            f"{held}{note}")


def engine_modes(config, device="cpu", dp: int = 2) -> str:
    """What the gradient and parameter paths of ``config`` (a ``ZeroConfig``) do on ``device``
    at data-parallel size ``dp``, in words with their Megatron-LM flags (issue 33). ZeRO++'s
    quantized collectives are not named at ``dp`` 1, where there is nothing to quantize (the
    start-up note says so)."""
    grads = "bf16 (--grad-reduce-in-bf16)" if config.grad_reduce_in_bf16 else "fp32"
    fusion = fusion_words(config, device)
    reduce = ("reduced during backward (--overlap-grad-reduce)" if config.overlap_comm
              else "reduced after backward (--no-overlap-grad-reduce)")
    if getattr(config, "quantized_gradients", False) and dp > 1:
        reduce += (f" as int{config.quantized_gradients_bits} over an intra- then inter-node "
                   "all-to-all (--zero-quantized-gradients)")
    if config.stage == 0:
        gather = "parameters copied from the master after the step (stage 0)"
    elif config.overlap_param_gather:
        gather = ("updated parameters all-gathered in the background, waited unit by unit in "
                  "the next forward (--overlap-param-gather)")
    else:
        gather = ("updated parameters all-gathered before the step returns "
                  "(--overlap-param-gather off)")
    zpp = "".join((f"; ZeRO++ hpZ: backward gathers inside the node over "
                   f"{config.hpz_partition_size} ranks" if config.hpz_partition_size > 1 else "",
                   "; ZeRO++ qwZ: int8 parameter gathers" if config.quantized_weights and dp > 1
                   else ""))
    return f"gradients {grads}, {fusion}, {reduce}; {gather}{zpp}"
