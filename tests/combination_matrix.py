"""The options that change a training step, their values as Megatron-LM flags, and the pairwise
covering array over them that ``tests/test_combinations.py`` runs.

A *configuration* picks one value of every option of :data:`OPTIONS`. It is *valid* when the
trainer accepts it (:func:`hybrid.job.cli.parse_config` and
:func:`hybrid.job.config_checks.validate` on a 4-rank world raise no ``ConfigError``; the rules
are the trainer's, not restated here) and no option of it is *inert* (accepted but without
effect, so that it would cover its pairs without testing them: ``--sequence-parallel`` at tp 1,
which the trainer disables; a 2-node topology without hpZ or qgZ, the only options that read it;
qwZ or qgZ at data-parallel size 1, where no data-parallel collective moves).
:func:`covering_array` asks allpairspy (a covering-array generator) for rows in which every
pair of values of two options that some valid configuration holds appears at least once, with
:func:`valid` as its filter. The options are ordered so that those a value needs come first
(tp, precision and stage before SP, offload or ZeRO++; ZeRO++ before the node layout; full
recompute before Pa) and the first value of each is the plain one that nothing refuses: a
prefix of a row completed with plain values is then valid exactly when some completion is,
which is the filter's contract with allpairspy's depth-first search (a new option keeps both
properties: its plain value first, after the options its values need).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
from dataclasses import dataclass

from hybrid.zero.topology import NODE_SIZE_ENV

WORLD = 4
"""Ranks of the world every configuration runs on (tp x dp)."""
MICRO_BATCH = 2
"""Samples per micro-batch in every configuration (the global batch follows from dp and the
accumulation steps), so that compiled regions see few shapes."""
ITERATIONS = 3
BASE = ("--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8",
        "--seq-length", "32", "--max-position-embeddings", "32", "--mock-data", "--vocab-size",
        "256", "--micro-batch-size", str(MICRO_BATCH), "--train-iters", str(ITERATIONS),
        "--lr", "3e-3", "--lr-decay-style", "constant", "--weight-decay", "0.1",
        "--eval-iters", "0", "--log-interval", "1", "--seed", "7")
"""Flags of every run: a 2-block model of width 64, 8 heads, 32 positions, a 256-token mock
vocabulary, 3 iterations at a constant lr 3e-3, clipped at the default 1.0 (active: the first
gradient norms are 1.1-2.8), no evaluation."""

OPTIONS: dict[str, dict[str, tuple[str, ...]]] = {
    # grid and precision first: the options below need them
    "tp": {t: ("--tensor-model-parallel-size", t) for t in ("1", "2", "4")},
    "precision": {"fp32": (), "bf16": ("--bf16",),
                  # the dynamic scale's default start 2**32 overflows and skips the first steps
                  "fp16": ("--fp16", "--initial-loss-scale", "4096")},
    "zero_stage": {s: ("--zero-stage", s) for s in ("0", "1", "2", "3")},
    "sequence_parallel": {"off": (), "on": ("--sequence-parallel",)},
    "tp_comm_overlap": {"off": (), "on": ("--tp-comm-overlap",)},
    "optimizer_cpu_offload": {"off": (), "on": ("--optimizer-cpu-offload",)},
    "overlap_param_gather": {"off": (), "on": ("--overlap-param-gather",)},
    "grad_reduce_in_bf16": {"off": (), "on": ("--grad-reduce-in-bf16",)},
    "hpz": {"off": (), "2": ("--zero-hpz-partition-size", "2")},
    "qwz": {"off": (), "on": ("--zero-quantized-weights",)},
    "qgz": {"off": (), "on": ("--zero-quantized-gradients",)},
    "nodes": {"1x4": (), "2x2": ()},  # HYBRID_LOCAL_WORLD_SIZE: see Configuration.env
    "recompute": {"none": (), "full": ("--recompute-granularity", "full"),
                  "selective": ("--recompute-granularity", "selective")},
    "pa": {"off": (), "on": ("--partition-activations",),
           "cpu": ("--partition-activations", "--checkpoint-in-cpu")},
    "kernel_fusion": {"off": ("--kernel-fusion", "off"), "on": ("--kernel-fusion", "on")},
    # the model
    "normalization": {n: ("--normalization", n) for n in ("LayerNorm", "RMSNorm")},
    "layernorm_1p": {"off": (), "on": ("--apply-layernorm-1p",)},
    "qk_layernorm": {"off": (), "on": ("--qk-layernorm",)},
    "attention": {"mha": (), "gqa": ("--group-query-attention", "--num-query-groups", "4")},
    "embeddings": {"tied": (), "untied": ("--untie-embeddings-and-output-weights",)},
    "bias": {"all": (), "none": ("--disable-bias-linear",),
             "qkv": ("--disable-bias-linear", "--add-qkv-bias")},
    "position": {"learned": ("--position-embedding-type", "learned_absolute"),
                 "rope": ("--position-embedding-type", "rope"),
                 "rope_interleaved": ("--position-embedding-type", "rope",
                                      "--rotary-interleaved")},
    "documents": {"packed": (), "reset": ("--reset-position-ids", "--reset-attention-mask")},
    "mlp": {"gelu": (), "swiglu": ("--swiglu",)},
    "dropout": {"off": ("--hidden-dropout", "0", "--attention-dropout", "0"),
                "on": ("--hidden-dropout", "0.1", "--attention-dropout", "0.1")},
    "accumulation": {"1": (), "2": ()},  # micro-batches per step: see Configuration.argv
}
"""Option -> {value label: its flags}. The first value of each is the plain one (the trainer's
default where Megatron-LM has one). Every flag that changes the step joins here, in the change
that adds it (``tests/test_combinations.py``)."""

ZERO_OPTIONS = ("zero_stage", "optimizer_cpu_offload", "overlap_param_gather", "hpz", "qwz", "qgz",
                "nodes")
"""What the README's dropout claim spans: every ZeRO stage (offload, ZeRO++ and the parameter
gather included) on the same grid gives the same loss."""
RECOMPUTE_OPTIONS = ("recompute", "pa")
"""Activation recompute replays the dropout masks of the forward (``models.fusion``)."""
MODEL_OPTIONS = ("normalization", "layernorm_1p", "qk_layernorm", "attention", "embeddings", "bias",
                 "position", "documents", "mlp", "dropout")
"""The options of the model itself: what a single-process reference keeps."""


@dataclass(frozen=True)
class Configuration:
    """One value of every option (``values``: option -> label, in :data:`OPTIONS` order)."""

    values: tuple[tuple[str, str], ...]

    @classmethod
    def of(cls, labels) -> Configuration:
        """From the labels of :data:`OPTIONS`' options, in order (missing trailing options take
        their first value)."""
        labels = list(labels)
        full = labels + [next(iter(v)) for v in list(OPTIONS.values())[len(labels):]]
        return cls(tuple(zip(OPTIONS, full, strict=True)))

    def __getitem__(self, option: str) -> str:
        return dict(self.values)[option]

    def replace(self, **changes: str) -> Configuration:
        """This configuration with some options' labels changed."""
        return Configuration(tuple((k, changes.get(k, v)) for k, v in self.values))

    @property
    def dp(self) -> int:
        return WORLD // int(self["tp"])

    @property
    def global_batch(self) -> int:
        return MICRO_BATCH * int(self["accumulation"]) * self.dp

    @property
    def argv(self) -> list[str]:
        """The ``hybrid.pretrain`` flags of this configuration."""
        flags = [f for option, label in self.values for f in OPTIONS[option][label]]
        return [*BASE, *flags, "--global-batch-size", str(self.global_batch)]

    @property
    def env(self) -> dict[str, str]:
        """Environment variables of the run: ``HYBRID_LOCAL_WORLD_SIZE`` (ranks per node)."""
        return {NODE_SIZE_ENV: self["nodes"].split("x")[1]}

    @property
    def name(self) -> str:
        """The labels that differ from each option's first value, e.g. ``tp2-bf16-zero3``."""
        return "-".join(f"{k}={v}" for k, v in self.values if v != next(iter(OPTIONS[k])))


@contextlib.contextmanager
def environment(env: dict[str, str]):
    """``os.environ`` with ``env`` set, restored after."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@functools.cache
def refusal(config: Configuration) -> str | None:
    """Why the trainer refuses ``config`` on a :data:`WORLD`-rank world (its ``ConfigError``
    message), why it is inert, or None when it runs."""
    from hybrid.config_fields import ConfigError
    from hybrid.job.cli import parse_config
    from hybrid.job.config_checks import validate

    try:
        with environment(config.env):
            job = validate(parse_config(config.argv), world_size=WORLD, local_world_size=WORLD)
    except ConfigError as e:
        return str(e)
    if config["sequence_parallel"] == "on" and not job.cfg.grid.sequence_parallel_active:
        return "inert: --sequence-parallel at tp 1 (disabled by the trainer)"
    if config["nodes"] != "1x4" and config["hpz"] == "off" and config["qgz"] == "off":
        return "inert: nodes without hpZ or qgZ (nothing else reads them)"
    if job.dp == 1 and "on" in (config["qwz"], config["qgz"]):
        return "inert: qwZ / qgZ at data-parallel size 1 (no data-parallel collective to quantize)"
    return None


def valid(labels) -> bool:
    """allpairspy's filter: a prefix of a row (labels in :data:`OPTIONS` order) is valid when
    completed with the first value of every later option."""
    return refusal(Configuration.of(labels)) is None


@contextlib.contextmanager
def one_parser():
    """``hybrid.job.cli`` building its argparse parser and reading its fields' annotations once
    instead of once per parse (10 ms -> 1 ms a parse), while the covering array asks the trainer
    about a few thousand configurations."""
    from unittest import mock

    from hybrid import field_flags
    from hybrid.job import cli

    annotation = functools.cache(field_flags.annotation)
    with (mock.patch.object(cli, "build_parser", functools.cache(cli.build_parser)),
          mock.patch.object(cli, "annotation", annotation),
          mock.patch.object(field_flags, "annotation", annotation)):
        yield


def all_pairs():
    """Every pair of values of two different options: ``((option, label), (option, label))``."""
    for (a, va), (b, vb) in itertools.combinations(OPTIONS.items(), 2):
        for x, y in itertools.product(va, vb):
            yield (a, x), (b, y)


def covers(config: Configuration, pair) -> bool:
    """Whether ``config`` holds both values of ``pair``."""
    return all(config[option] == label for option, label in pair)


SEARCH_BUDGET = 200
"""Prefixes :func:`completion`'s depth-first search tries before giving up on a pair."""


def completion(pair, rows: list[Configuration]) -> Configuration | None:
    """A valid configuration holding ``pair``, or None when none was found: the plain
    configuration with the pair set, each of ``rows`` with it set, then depth first over the
    options in order (each prefix tried completed with the pair and plain values, and abandoned
    when invalid even with plain values), within :data:`SEARCH_BUDGET` configurations."""
    fixed, names, budget = dict(pair), list(OPTIONS), [SEARCH_BUDGET]
    for start in [Configuration.of([]), *rows]:
        if refusal(start.replace(**fixed)) is None:
            return start.replace(**fixed)

    def filled(labels: list[str]) -> Configuration:
        return Configuration.of(labels).replace(**{o: fixed.get(o, c) for o, c in zip(
            names[len(labels):], (next(iter(OPTIONS[o])) for o in names[len(labels):]),
            strict=True)})

    def search(labels: list[str]) -> Configuration | None:
        budget[0] -= 1
        if refusal(filled(labels)) is None:
            return filled(labels)
        if budget[0] < 0 or len(labels) == len(names) or not valid(labels):
            return None
        option = names[len(labels)]
        for label in [fixed[option]] if option in fixed else OPTIONS[option]:
            if (found := search(labels + [label])) is not None:
                return found
        return None

    return search([])


def _allpairs(fused: str, previous: list[Configuration]) -> list[Configuration]:
    """allpairspy's rows with ``kernel_fusion`` = ``fused``, adding to ``previous``."""
    from allpairspy import AllPairs

    at = list(OPTIONS).index("kernel_fusion")
    old = {tuple(label for _, label in c.values) for c in previous}

    def accept(labels) -> bool:
        return tuple(labels) in old or ((len(labels) <= at or labels[at] == fused)
                                         and valid(labels))

    return [Configuration.of(r) for r in AllPairs(
        [list(v) for v in OPTIONS.values()], filter_func=accept,
        previously_tested=[[label for _, label in c.values] for c in previous] or None)]


@functools.cache
def covering_array() -> tuple[tuple[Configuration, ...], tuple]:
    """``(configurations, infeasible pairs)``.

    allpairspy builds the rows in two passes: without kernel fusion, then with it (its second
    pass starts from the first's pairs, so the compiled configurations, 10-30 s of torch.compile
    per region and shape on a 2-core CPU, are as few as their pairs need). Its greedy search
    stops at a row that adds no pair, which leaves out pairs that need several options set
    together (qwZ with tp-comm-overlap: ZeRO-3, 16-bit, SP, tp > 1); each of those gets one row
    from :func:`completion`, packed with as many other missing pairs as stay valid. The pairs
    for which :func:`completion` finds no valid configuration are returned too (a search 15
    times as long, 3000 configurations per pair, finds the same 27).

    Cost: some 3,200 configurations asked of the trainer, 5-15 s (at collection time).
    """
    with one_parser():
        rows = _allpairs("off", [])
        rows += _allpairs("on", rows)[len(rows):]
        missing = [p for p in all_pairs() if not any(covers(r, p) for r in rows)]
        infeasible = []
        while missing:
            row = completion(missing[0], rows)
            if row is None:
                infeasible.append(missing.pop(0))
                continue
            held = [missing[0]]
            for pair in missing[1:]:  # pack the other missing pairs this row can hold
                packed = row.replace(**dict(pair))
                if all(covers(packed, p) for p in held) and refusal(packed) is None:
                    row = packed
                    held.append(pair)
            rows.append(row)
            missing = [p for p in missing if not covers(row, p)]
    return tuple(rows), tuple(infeasible)
