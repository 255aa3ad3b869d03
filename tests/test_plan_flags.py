"""One declaration per flag (issue 42 item 3): every flag ``hybrid.plan`` shares with
``hybrid.pretrain`` is built from the same :func:`hybrid.config_fields.arg` field, with the same
default and choices unless the planner searches it (or takes a preset's recipe), and the ZeRO++
and offload rules are stated once, in ``ZeroConfig``'s validation, which the planner calls.

Both parsers are introspected: each flag's action carries its field
(:func:`hybrid.field_flags.add_field`).
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

import pytest

from hybrid.config_fields import ConfigError, flag_of
from hybrid.field_flags import default_of
from hybrid.job.cli import build_parser as pretrain_parser
from hybrid.job.cli import parse_config
from hybrid.planner.cli import build_parser as plan_parser
from hybrid.planner.cli_args import zero_config
from hybrid.planner.inputs import layout_zero
from hybrid.zero.config import STAGE_SETTINGS, ZeroConfig

ROOT = Path(__file__).resolve().parents[1]

PLAN_DEFAULTS = {
    "--zero-stage": None,  # searched: every stage (repeatable, each given restricts it)
    "--tensor-model-parallel-size": None,  # searched (its name --tp too)
    "--micro-batch-size": None,  # searched within the global batch (repeatable)
    "--optimizer-cpu-offload": None,  # searched: none, half or all of the optimizer
    "--optimizer-offload-fraction": None,  # searched: 0, 0.5, 1 (1.0 when forced on)
    "--precision": "bf16",  # a planned run trains in 16 bits
    "--seq-length": None,  # the --model preset's recipe, else 1024 (model_flags)
    "--hidden-dropout": None,  # the preset's recipe, else 0.1
    "--attention-dropout": None,  # the preset's recipe, else 0.1
}
"""The shared fields (by their flag; their ``--no-`` and alias flags alike) whose planner default
is not the field's, and why."""

SHARED = (60, 43)
"""Shared flags: option strings both parsers take (``--help`` aside; with the ``--no-`` forms and
the alias flags such as ``--bf16``), and the fields they set: 21 of ``ModelConfig``, 15 of
``ZeroConfig``, 2 of ``GridConfig``, 2 of ``TrainingConfig``, 3 of ``DryRunConfig``."""


def _by_flag(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s: a for a in parser._actions for s in a.option_strings if s not in ("-h", "--help")}


def shared_flags() -> dict[str, tuple[argparse.Action, argparse.Action]]:
    """``{flag: (pretrain's action, the planner's)}`` for every flag both commands take."""
    run, plan = _by_flag(pretrain_parser()), _by_flag(plan_parser())
    return {flag: (run[flag], plan[flag]) for flag in sorted(set(run) & set(plan))}


def test_every_shared_flag_comes_from_the_same_field_with_its_default_and_choices():
    shared = shared_flags()
    assert (len(shared), len({id(p.field) for _, p in shared.values()})) == SHARED, sorted(shared)
    for flag, (run, plan) in shared.items():
        assert getattr(plan, "field", None) is not None, f"{flag}: declared by hand in hybrid.plan"
        assert plan.field is run.field, flag
        assert plan.choices == run.choices, flag
        assert run.default is argparse.SUPPRESS  # pretrain's default is the field's own
        own = flag_of(plan.field)
        assert plan.field_default == PLAN_DEFAULTS.get(own, default_of(plan.field)), flag
    for flag, default in PLAN_DEFAULTS.items():  # each exception is one
        assert default != default_of(shared[flag][1].field), flag


def test_the_same_zero_flags_give_the_same_zero_config():
    """What the planner plans at a stage is what ``hybrid.pretrain`` runs with the same flags."""
    argv = ["--bf16", "--zero-hpz-partition-size", "2", "--zero-quantized-weights",
            "--zero-quantized-gradients", "--zero-quantized-gradients-bits", "8",
            "--reduce-bucket-size", "1000", "--param-persistence-threshold", "0",
            "--no-gradient-accumulation-fusion", "--overlap-param-gather"]
    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]
    args = plan_parser().parse_args([*base, *argv])
    for stage in range(4):
        run = parse_config([*base, *argv, "--zero-stage", "3"]).zero.at_stage(stage)
        assert layout_zero(zero_config(args), stage) == run, stage


@pytest.mark.parametrize("argv, phrase", [
    (["--zero-stage", "1", "--zero-stage", "2", "--zero-hpz-partition-size", "2"],
     "hpZ partitions the ZeRO-3 parameters a second time"),
    (["--zero-stage", "2", "--zero-quantized-weights"], "qwZ quantizes the ZeRO-3 parameter"),
    (["--zero-stage", "1", "--zero-quantized-gradients"], "qgZ quantizes the ZeRO-2/3 gradient"),
    (["--grad-reduce", "all_reduce", "--zero-quantized-gradients"],
     "qgZ replaces the gradient reduce-scatter"),
    (["--precision", "fp32", "--zero-quantized-gradients"], "qgZ replaces 16-bit gradient"),
    (["--precision", "fp32", "--zero-quantized-weights"], "qwZ replaces 16-bit parameter"),
    (["--zero-stage", "0", "--optimizer-cpu-offload"], "offloads the partition of ZeRO 1-3"),
    (["--zero-stage", "0", "--overlap-param-gather"], "stage 0 gathers no parameters"),
    (["--optimizer-offload-fraction", "1.5"], "must be a number in [0, 1]"),
    (["--fp16", "--grad-reduce-in-bf16"], "bf16 gradients need bf16 training"),
    (["--zero-stage", "4"], "--zero-stage 4 (ZeroConfig.stage): valid values are 0, 1, 2, 3"),
])
def test_the_planner_refuses_with_zero_configs_words(argv, phrase):
    """Each refusal is ZeroConfig's (its words are nowhere else: :data:`REFUSALS`), at the
    highest stage the planner searches, where ``hybrid.pretrain`` refuses the same flags."""
    with pytest.raises(ConfigError) as e:
        zero_config(plan_parser().parse_args(argv))
    assert phrase in str(e.value)


def test_alias_flags_conflict_as_in_pretrain(capsys):
    """``--bf16`` / ``--fp16`` come with ``--precision``'s field, and conflict as they do in
    ``hybrid.pretrain`` (an argparse error here, exit 2)."""
    assert plan_parser().parse_args(["--fp16"]).precision == "fp16"
    for argv in (["--bf16", "--fp16"], ["--fp16", "--precision", "bf16"],
                 ["--precision", "fp16", "--bf16"]):
        with pytest.raises(SystemExit):
            plan_parser().parse_args(argv)
        assert "are mutually exclusive" in capsys.readouterr().err
        with pytest.raises(ConfigError, match="are mutually exclusive"):
            parse_config(argv)


REFUSALS = {
    "qgZ quantizes the ZeRO-2/3 gradient": "hybrid/zero/config.py",
    "qgZ replaces the gradient reduce-scatter": "hybrid/zero/config.py",
    "qgZ replaces 16-bit gradient reduce-scatters": "hybrid/zero/config.py",
    "hpZ partitions the ZeRO-3 parameters a second": "hybrid/zero/config.py",
    "a node holds {self.dp_per_node} data-parallel ": "hybrid/zero/topology.py",
    "qwZ quantizes the ZeRO-3 parameter gathers": "hybrid/zero/config.py",
    "qwZ replaces 16-bit parameter gathers": "hybrid/zero/config.py",
    "offloads the partition of ZeRO 1-3": "hybrid/zero/config.py",
    "must be a number in [0, 1] (the share": "hybrid/zero/config.py",
    "stage 0 gathers no parameters": "hybrid/zero/config.py",
    "bf16 gradients need bf16 training": "hybrid/zero/config.py",
}
"""Each ZeRO++ / offload refusal's wording and the one file under ``hybrid/`` that states it."""


@pytest.mark.parametrize("words", sorted(REFUSALS))
def test_each_refusal_is_stated_in_one_file(words):
    found = subprocess.run(["grep", "-rlF", "--include=*.py", words, "hybrid"], cwd=ROOT,
                           capture_output=True, text=True).stdout.split()
    assert found == [REFUSALS[words]]


def test_stage_settings_are_off_below_their_stage():
    z = ZeroConfig(stage=3, precision="bf16", optimizer_cpu_offload=True,
                   overlap_param_gather=True, quantized_gradients=True, hpz_partition_size=2,
                   quantized_weights=True)
    for stage in range(4):
        at = z.at_stage(stage)
        for name, (lowest, off) in STAGE_SETTINGS.items():
            assert (getattr(at, name) == off) == (stage < lowest), (stage, name)
    with pytest.raises(ConfigError, match="offloads the partition of ZeRO 1-3"):
        z.at_stage(0, optimizer_cpu_offload=True)
