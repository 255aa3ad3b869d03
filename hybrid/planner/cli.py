"""Command line of the memory planner: ``python -m hybrid.plan [--json] [--max-model] ...``.

Flag names follow Megatron-LM where one exists; a flag ``hybrid.pretrain`` also takes is built
from the same config field (:mod:`hybrid.planner.cli_args`,
:func:`hybrid.model_flags.add_model_args`), so ``--preset`` (``--model``),
``--tensor-model-parallel-size`` (``--tp``), ``--bf16`` and the rest mean the same in both, and
the ZeRO settings are refused as the run's ``ZeroConfig`` refuses them. Memory is in GiB
(2^30 bytes) everywhere, on the command line, in the table and in the device presets;
bandwidths are in GB/s (1e9 bytes/s, as links are quoted); bucket sizes in elements. Bad input
(tp not dividing the heads, GPUs not divisible by GPUs per node, non-positive sizes) exits
with status 2 and a message naming the value.

``--device`` picks a GPU preset (:mod:`hybrid.devices`: the memory CUDA reports and the
datasheet's dense peak); ``--gpu-memory-gib`` and ``--peak-tflops`` override its two figures. A
memory given without a device or a peak is refused when planning: the step time would silently
use another GPU's peak.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from typing import TYPE_CHECKING

from hybrid.config import GridConfig
from hybrid.config_fields import ConfigError, choices_hints, flag_hints
from hybrid.devices import (
    DEFAULT_DEVICE,
    GIB,
    device_memory_gib,
    device_preset,
    preset_names,
)
from hybrid.field_flags import check_aliases, fill_defaults
from hybrid.flops import device_peak_tflops, num_parameters
from hybrid.model_flags import add_model_args, apply_preset_defaults, model_from_args
from hybrid.planner.cli_args import (
    add_cluster_args,
    add_search_args,
    add_training_args,
    assumed_line,
    network,
    offload_fractions,
    zero_config,
)
from hybrid.planner.inputs import Cluster, Training
from hybrid.planner.max_model import max_layers, max_params, max_params_offloaded
from hybrid.planner.memory import ACTIVATION_OPTIONS, ZERO_STAGES
from hybrid.planner.plan import best, plan, tp_candidates
from hybrid.planner.table import max_model_text, plan_text

if TYPE_CHECKING:
    from collections.abc import Callable

    Verify = Callable[..., tuple[dict, list[str]] | None]


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line naming the flag, like ``hybrid.pretrain`` (the usage is in
    --help): the closest valid flag, or the valid values of a flag given without one. The flags
    declared by config fields (:mod:`hybrid.field_flags`) get their defaults after parsing, and
    two alias flags that disagree (``--bf16 --fp16``) are such an error."""

    def error(self, message: str):
        flags = [s for a in self._actions for s in a.option_strings if s.startswith("--")]
        hints = [*flag_hints(message, flags), *choices_hints(message, self._actions)]
        self.exit(2, f"{self.prog}: error: {'; '.join([message, *hints])} (see --help)\n")

    def parse_known_args(self, args=None, namespace=None):
        try:
            ns, extra = super().parse_known_args(args, namespace)
            check_aliases(vars(ns))
        except ConfigError as e:
            self.error(str(e))
        fill_defaults(self, ns)
        return ns, extra


class _HelpFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to every help text whose flag has a real default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "%(default)" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    """The planner's argument parser (groups: model, training, cluster, search; ``--json``)."""
    p = _Parser(
        allow_abbrev=False,
        prog="python -m hybrid.plan",
        formatter_class=_HelpFormatter,
        epilog="Table columns: tp, dp = tensor- and data-parallel degree; z = ZeRO stage; m = "
        "micro-batches per step per data-parallel rank (gradient accumulation steps = global "
        "batch / (micro-batch * dp)); params ... buffers = GiB (2^30 bytes) per rank; reserve = "
        "--reserved-gib; total = their sum; dpGiB, tpGiB = GiB each rank sends per step.",
        description="Per-rank memory, traffic and a step-time estimate for every TP x ZeRO x "
        "activation-checkpointing layout; picks the fastest one that fits.",
    )
    add_model_args(p.add_argument_group("model"))
    add_training_args(p.add_argument_group("training"))
    add_cluster_args(p.add_argument_group("cluster"))
    add_search_args(p.add_argument_group("search"))
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--verify", action="store_true",
                   help="then run the dry run of the best layout for rank 0 (hybrid.pretrain "
                   "--dry-run-world-size, minutes on a CPU) and print both totals and verdicts")
    return p


def _cluster(args: argparse.Namespace, planning: bool) -> Cluster:
    """The cluster from ``--device`` and its overrides (``planning``: the peak is used)."""
    memory = device_memory_gib(args.device, args.gpu_memory_gb, args.reserved_gb)
    if (
        planning
        and args.device is None
        and args.gpu_memory_gb is not None
        and args.peak_tflops is None
    ):
        raise ValueError(
            f"--gpu-memory-gib {args.gpu_memory_gb:g} without --device: the step time needs "
            f"the GPU's peak; give --device ({preset_names()}) or --peak-tflops"
        )
    preset = device_preset(args.device or DEFAULT_DEVICE)
    peak = args.peak_tflops
    if peak is None:
        peak = preset.peak_tflops if preset else device_peak_tflops(args.device)
    if peak is None:
        raise ValueError(
            f"--device {args.device!r} has no known peak; give --peak-tflops or a preset "
            f"({preset_names()})"
        )
    return _with_flag_names(
        Cluster,
        num_gpus=args.num_gpus,
        gpus_per_node=(args.gpus_per_node if args.gpus_per_node is not None
                       else min(8, args.num_gpus) if args.num_gpus > 0 else 8),
        gpu_memory_bytes=memory * GIB,
        reserved_bytes=args.reserved_gb * GIB,
        peak_tflops=peak,
        efficiency=args.efficiency,
        **{field: value for field, (value, _) in network(args, preset).items()},
        hbm_gbs=(args.hbm_gbs if args.hbm_gbs is not None
                 else preset.hbm_gbs if preset else Cluster.hbm_gbs),
        **_host(args, preset),
    )


def _host(args: argparse.Namespace, preset) -> dict:
    """The cluster's host side (``Cluster.cpu_gbs``, ``host_*``): each flag, else the
    ``--device`` preset's server (:mod:`hybrid.devices`), else ``Cluster``'s defaults."""
    if args.host_memory_gib is not None and args.host_memory_gib <= 0:
        raise ValueError(f"--host-memory-gib must be positive (GiB of host DRAM per node), got "
                         f"{args.host_memory_gib:g}")

    def pick(value, field: str, default):
        return value if value is not None else getattr(preset, field) if preset else default

    memory = pick(args.host_memory_gib, "host_memory_gib", Cluster.host_memory_bytes / GIB)
    return {"cpu_gbs": pick(args.cpu_gbs, "host_link_gbs", Cluster.cpu_gbs),
            "host_memory_bytes": memory * GIB,
            "host_memory_gbs": pick(args.host_dram_gbs, "host_memory_gbs",
                                    Cluster.host_memory_gbs),
            "host_efficiency": args.host_efficiency}


def _device_label(args: argparse.Namespace) -> str:
    """``A100-80GB``, ``H100 (memory overridden)``, ``custom``: where the figures came from."""
    name = args.device or (DEFAULT_DEVICE if args.gpu_memory_gb is None else None)
    preset = device_preset(name) if name else None
    if preset is None:
        return name or "custom"
    changed = [
        what
        for what, value in (("memory", args.gpu_memory_gb), ("peak", args.peak_tflops))
        if value is not None
    ]
    return preset.name + (f" ({' and '.join(changed)} overridden)" if changed else "")


# Planner fields -> the flags that set them, for error messages.
_FLAG_OF = {
    "num_gpus": "--num-gpus", "gpus_per_node": "--gpus-per-node",
    "reserved_bytes": "--reserved-gib",
    "peak_tflops": "--peak-tflops", "efficiency": "--efficiency",
    "intra_node_gbs": "--intra-node-gbs", "inter_node_gbs": "--inter-node-gbs",
    "cpu_gbs": "--cpu-gbs", "hbm_gbs": "--hbm-gbs", "seq_length": "--seq-length",
    "micro_batch_size": "--micro-batch-size",
    "global_batch_size": "--global-batch-size",
    "make_vocab_size_divisible_by": "--make-vocab-size-divisible-by",
    "host_memory_gbs": "--host-dram-gbs", "host_efficiency": "--host-efficiency",
}


def _check_fixed_layout(args: argparse.Namespace) -> None:
    """ConfigError (a ValueError) when ``--tp-comm-overlap`` cannot apply to any of the ``--tp``
    values given: :class:`GridConfig` refuses it at the largest, with sequence parallelism on
    (a searched tp, or sequence parallelism, gets the flag where it applies)."""
    if args.tp_comm_overlap and args.tp:
        GridConfig(tensor_model_parallel_size=max(args.tp), sequence_parallel=True,
                   tp_comm_overlap=True)


def _with_flag_names(kind, **kwargs):
    """``kind(**kwargs)``, its ValueError rewritten to name flags instead of field names."""
    try:
        return kind(**kwargs)
    except ValueError as e:
        msg = str(e)
        for field, flag in _FLAG_OF.items():
            msg = re.sub(rf"\b{field}=?", f"{flag} ", msg)
        raise ValueError(re.sub(r" +", " ", msg)) from None


def _training(args: argparse.Namespace) -> Training:
    for b in args.micro_batch_size or ():
        if b <= 0:
            raise ValueError(f"--micro-batch-size must be positive, got {b}")
    return _with_flag_names(
        Training,
        seq_length=args.seq_length,
        micro_batch_size=(args.micro_batch_size or [1])[0],
        global_batch_size=args.global_batch_size,
        accounting=args.accounting,
        zero=zero_config(args),
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        tp_comm_overlap=args.tp_comm_overlap,
        dropout=args.hidden_dropout > 0 or args.attention_dropout > 0,
    )


def _max_model(args, model, cluster, training) -> list[dict]:
    rows = []
    tps = args.tp or (
        tp_candidates(model, cluster)
        if model
        else [
            t for t in (1, 2, 4, 8, 16) if t <= cluster.gpus_per_node and cluster.num_gpus % t == 0
        ]
    )
    budget = cluster.gpu_memory_bytes - cluster.reserved_bytes
    for tp in tps:
        dp = cluster.num_gpus // tp
        for stage in args.zero_stage or ZERO_STAGES:
            row = {
                "tp": tp,
                "dp": dp,
                "stage": stage,
                "max_params_model_states": max_params(
                    budget, tp, dp, stage, training.zero.precision, training.accounting
                ),
                "max_params_offloaded": None if stage == 0 or args.optimizer_cpu_offload is False
                else max_params_offloaded(budget, cluster.host_memory_bytes,
                                          cluster.gpus_per_node, tp, dp, stage,
                                          training.zero.precision, training.accounting,
                                          max(offload_fractions(args, training.zero))),
            }
            if model is not None:
                layers = {
                    a: max_layers(model, cluster, training, tp, stage, a)
                    for a in args.activation or ACTIVATION_OPTIONS
                    if not (tp == 1 and a == "full+pa")
                }
                row["max_layers"] = layers
                row["max_params_with_activations"] = {
                    a: num_parameters(dataclasses.replace(model, num_layers=n)) if n else 0
                    for a, n in layers.items()
                }
            rows.append(row)
    return rows


def main(argv: list[str] | None = None, verify: Verify | None = None) -> int:
    """The planner's command line (``hybrid.plan`` / ``hybrid-plan`` call it); returns the exit
    status (2 for bad input). Output piped into a reader that stops early (``| head``) ends
    quietly, as Unix tools do.

    Args:
        verify: ``--verify``'s step, which the entry point gives
            (:func:`hybrid.dryrun.verify.verify_plan`: the dry run stands above the planner):
            called as ``verify(args, model, training, cluster, chosen)``, it returns ``(result,
            comparison lines)``, or None when nothing fits. Without it ``--verify`` is refused
            (status 2) before planning.
    """
    try:
        return _main(argv, verify)
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python's own flush at exit must not fail again
        return 0


def _main(argv: list[str] | None, verify: Verify | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from_preset = apply_preset_defaults(args)
    try:
        if args.verify and verify is None:  # the dry run stands above the planner
            raise ValueError("--verify needs the entry point: python -m hybrid.plan (hybrid-plan)")
        model = model_from_args(args, required=not args.max_model)
        cluster = _cluster(args, planning=not args.max_model)
        training = _training(args)
        _check_fixed_layout(args)
        if args.max_model:
            rows = _max_model(args, model, cluster, training)
            budget = cluster.gpu_memory_bytes - cluster.reserved_bytes
            print(json.dumps({"max_model": rows}, indent=1) if args.json
                  else max_model_text(rows, budget))
            return 0
        fractions = offload_fractions(args, training.zero)
        cands, skipped = plan(
            model,
            cluster,
            training,
            args.tp,
            tuple(args.zero_stage or ZERO_STAGES),
            tuple(args.activation or ACTIVATION_OPTIONS),
            micro_batch_sizes=tuple(args.micro_batch_size or ()),
            # searched within a given global batch (without one, it is b * GPUs: b is given)
            search_micro_batch=not args.micro_batch_size and args.global_batch_size is not None,
            offload_fractions=fractions,
        )
        if not cands:
            raise ValueError(no_layout_message(skipped, args.model, from_preset))
    except ValueError as err:  # one line, like hybrid.pretrain (the usage is in --help)
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    chosen = best(cands)
    if args.json:  # the dry run streams its lines to stderr, before the document
        checked = verify(args, model, training, cluster, chosen) if args.verify else None
        json.dump(_json_document(args, model, cluster, training, (cands, skipped, chosen),
                                 from_preset, fractions, checked), sys.stdout, indent=1)
        print()
        return 0
    notes = [assumed_line(args, device_preset(args.device or DEFAULT_DEVICE), cluster, training,
                          from_preset), preset_note(args.model, from_preset)]
    print(plan_text(model, cluster, training, cands, skipped, chosen, args.fitting_only,
                    _device_label(args), "\n".join(filter(None, notes))), flush=True)
    checked = verify(args, model, training, cluster, chosen) if args.verify else None
    if checked is not None:
        print("\n".join(checked[1]))
    return 0


def _json_document(args, model, cluster, training, found, from_preset, fractions,
                   checked) -> dict:
    """``--json``'s document: the inputs, every candidate, what was skipped and why, the best
    (``found``: ``(candidates, skipped, best)``) and ``--verify``'s verdict."""
    cands, skipped, chosen = found
    return {
        "model": dataclasses.asdict(model),
        "num_parameters": num_parameters(model),
        "device": _device_label(args),
        "defaults_from_preset": from_preset,
        "cluster": dataclasses.asdict(cluster),
        "training": dataclasses.asdict(training),
        "candidates": [c.as_dict() for c in cands],
        "skipped": skipped,
        "offload_fractions": list(fractions),
        "best": chosen.as_dict() if chosen else None,
        "verify": checked[0] if checked else None,
    }


def preset_note(preset: str | None, taken: dict) -> str | None:
    """The header line naming the settings taken from the ``--model`` preset (None: none)."""
    if not taken:
        return None
    given = ", ".join(f"{flag} {value:g}" for flag, value in taken.items())
    return (f"defaults from the {preset} preset (its training recipe): {given}; give a flag "
            "to plan another")


def no_layout_message(skipped: list[str], preset: str | None = None,
                      from_preset: dict | None = None) -> str:
    """Why no layout was evaluated at all (every one was skipped, ``skipped`` says why): an
    error (exit 2), unlike "nothing fits in memory", which is an answer. A batch the ``--model``
    preset gave (``from_preset``, :func:`preset_note`) is named as the preset's."""
    if skipped and all("global_batch_size" in r for r in skipped):
        gbs = (from_preset or {}).get("--global-batch-size")
        whose = f" ({gbs}: the {preset} preset's)" if gbs else ""
        return (f"no layout divides the batch: --global-batch-size{whose} must be a multiple of "
                "--micro-batch-size * dp (dp = --num-gpus / tp) for some tp; " +
                "; ".join(skipped))
    return "no layout is possible: " + ("; ".join(skipped) or "no tp/stage/activation left")
