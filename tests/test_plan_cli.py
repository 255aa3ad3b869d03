"""The planner's command line: text, JSON, the max-model question, bad input, ``python -m``."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid import flops
from hybrid.planner import cli as plan_cli
from hybrid.planner import max_model
from tests.test_flops import gpt

GB = 1e9
GIB = 2**30
ROOT = Path(__file__).resolve().parents[1]

# CLI -----------------------------------------------------------------------------------------

DIMS = [
    "--num-layers",
    "48",
    "--hidden-size",
    "1600",
    "--num-attention-heads",
    "16",
    "--seq-length",
    "1024",
    "--micro-batch-size",
    "4",
    "--num-gpus",
    "8",
]


def test_cli_text(capsys):
    assert plan_cli.main(DIMS) == 0
    out = capsys.readouterr().out
    assert "best: tp=" in out and "MFU" in out


def test_cli_json(capsys):
    assert plan_cli.main([*DIMS, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["num_parameters"] == flops.num_parameters(gpt(48, 1600, 16, v=50257, s=1024))
    # 4 tps x 4 stages x 9 options; at tp=1 no full+pa and no sequence-parallel option (4);
    # stages 1-3 twice more with half and all the optimizer on the host (the offload search)
    assert len(doc["candidates"]) == 4 * 4 * 9 - 4 * 5 + 2 * (4 * 3 * 9 - 3 * 5)
    assert {c["offload_fraction"] for c in doc["candidates"] if c["stage"] == 0} == {0.0}
    assert doc["best"]["fits"] is True
    assert set(doc["best"]["model_states"]) == {"params", "grads", "master", "optimizer", "total"}


def test_cli_max_model(capsys):
    args = [
        "--max-model",
        "--num-gpus",
        "64",
        "--gpus-per-node",
        "8",
        "--gpu-memory-gib",
        "32",
        "--reserved-gib",
        "0",
        "--accounting",  # ZeRO Table 2's bytes per parameter (the default is the engine's)
        "paper",
        "--tp",
        "1",
        "--json",
    ]
    assert plan_cli.main(args) == 0
    rows = json.loads(capsys.readouterr().out)["max_model"]
    assert [r["max_params_model_states"] for r in rows] == [
        max_model.max_params(32 * GIB, 1, 64, s) for s in range(4)
    ]
    assert plan_cli.main([*DIMS, "--max-model", "--tp", "8", "--zero-stage", "3"]) == 0
    assert "layers" in capsys.readouterr().out
    width_only = ["--max-model", "--hidden-size", "1600", "--num-attention-heads", "16", "--json"]
    assert plan_cli.main(width_only) == 0
    rows = json.loads(capsys.readouterr().out)["max_model"]
    assert all(r["max_layers"]["full"] >= r["max_layers"]["none"] for r in rows)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--tp", "3"], "tp=3 must divide num_attention_heads=16"),
        (["--num-gpus", "12"], "--num-gpus 12 is not divisible by --gpus-per-node 8"),
        (["--hidden-size", "-5"], "--hidden-size must be positive, got -5"),
        (["--micro-batch-size", "0"], "--micro-batch-size must be positive, got 0"),
        (["--device", "H100", "--gpu-memory-gib", "-1"],
         "--gpu-memory-gib must be positive (GiB per GPU), got -1"),
        # nan and inf pass every comparison check: refused by the flag's type, in one line
        (["--device", "V100-32GB", "--gpu-memory-gb", "nan"],
         "argument --gpu-memory-gb: 'nan' is not a finite number"),
        (["--reserved-gb", "nan"],
         "argument --reserved-gb: 'nan' is not a finite number"),
        (["--peak-tflops", "inf"], "argument --peak-tflops: 'inf' is not a finite number"),
        (["--efficiency", "x"], "argument --efficiency: 'x' is not a number"),
        (["--efficiency", "2"], "--efficiency is a fraction of peak in (0, 1], got 2"),
        (["--reserved", "1"],
         "unrecognized arguments: --reserved 1; --reserved: did you mean --reserved-gib?"),
        (["--reserved-gib", "-1"],
         "--reserved-gib must be 0 or more (GiB held back per GPU), got -1"),
        (["--device", "V100-32GB", "--reserved-gib", "40"],
         "--reserved-gib 40 leaves nothing of the GPU's 31.75 GiB"),
    ],
)
def test_cli_bad_input_names_the_value(extra, message, capsys):
    with pytest.raises(SystemExit) as exc:
        plan_cli.main([*DIMS, *extra])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1, err  # one line, no usage block


def test_a_flag_with_choices_given_without_a_value_lists_them(capsys):
    with_choices = [a for a in plan_cli.build_parser()._actions if a.choices and a.option_strings]
    assert len(with_choices) >= 7  # --zero-stage's values are ZeroConfig's check, as in pretrain
    for action in with_choices:
        flag = action.option_strings[0]
        with pytest.raises(SystemExit) as exc:
            plan_cli.main([*DIMS, flag])
        err = capsys.readouterr().err
        valid = ", ".join(map(str, action.choices))
        assert exc.value.code == 2 and err.count("\n") == 1, err
        assert f"expected one argument; {flag}: valid values are {valid} (see --help)" in err


def test_python_dash_m_entry_point():
    run = subprocess.run(
        [sys.executable, "-m", "hybrid.plan", *DIMS, "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["best"] is not None


def test_cli_takes_a_preset_and_names_an_unknown_one(capsys):
    from hybrid.planner.cli import main

    assert main(["--model", "gpt2-124m", "--seq-length", "1024", "--micro-batch-size", "1",
                 "--num-gpus", "8", "--gpus-per-node", "8", "--device", "A100-80GB", "--json"]) in (
                     0, None)
    doc = json.loads(capsys.readouterr().out)
    assert doc
    with pytest.raises(SystemExit):
        main(["--model", "gpt-5", "--seq-length", "1024", "--num-gpus", "8"])
    assert "gpt2-124m" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # a near miss: the closest name is suggested
        main(["--model", "gpt-124m", "--num-gpus", "8", "--device", "H100"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.splitlines()) == 1, err
    assert "unknown model preset 'gpt-124m' (did you mean 'gpt2-124m'?); valid presets: " in err


@pytest.mark.parametrize(("tp", "rule"), [
    ("8", "tp=8 must divide num_attention_heads=12 and ffn_hidden_size=3072"),
    ("3", "tensor-model-parallel size 3 does not divide the world size 8"),
    ("16", "tp=16 must divide num_attention_heads=12 and ffn_hidden_size=3072; "
           "tensor-model-parallel size 16 does not divide the world size 8"),
    ("0", "tp=0 must be positive")])
def test_a_bad_tp_lists_the_valid_values(tp, rule, capsys):
    """gpt2-124m (12 heads) on 8 GPUs: 8 divides the GPUs but not the heads, so 1, 2, 4."""
    from hybrid.planner.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--model", "gpt2-124m", "--num-gpus", "8", "--device", "H100", "--tp", tp])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.splitlines()) == 1, err
    assert f"{rule}; valid --tp for this model on 8 GPUs: 1, 2, 4\n" in err


@pytest.mark.parametrize(
    ("device", "memory_mib", "peak"),
    [("V100-32GB", 32_510, 125), ("A100-40GB", 40_536, 312), ("a100-80gb", 81_920, 312),
     ("H100", 81_559, 989), ("H200", 143_771, 989)],
)
def test_cli_device_presets(device, memory_mib, peak, capsys):
    """Issue 13 item 18: device presets (the memory CUDA reports, as nvidia-smi's MiB, and the
    datasheet's dense bf16/fp16 peak); the runtime MFU table (flops.DEVICE_PEAK_TFLOPS) gives the
    same peak for the same name. Issue 28: memory in GiB, the unit of the table."""
    assert plan_cli.main([*DIMS, "--device", device, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["cluster"]["gpu_memory_bytes"] == memory_mib * 2**20
    assert doc["cluster"]["peak_tflops"] == peak == flops.device_peak_tflops(device)
    assert doc["device"].lower() == device.lower()


def test_cli_memory_without_device_is_refused_and_overrides_are_named(capsys):
    """Issue 13 item 18: '--gpu-memory-gb 32' alone planned with an A100's peak (312)."""
    with pytest.raises(SystemExit) as exc:
        plan_cli.main([*DIMS, "--gpu-memory-gib", "32"])
    assert exc.value.code == 2
    assert "--gpu-memory-gib 32 without --device: the step time needs the GPU's peak; give " \
        "--device (V100-32GB, A100-40GB, A100-80GB, H100, H200) or --peak-tflops" \
        in capsys.readouterr().err
    cases = [
        ([], "A100-80GB", 80, 312),  # the defaults: 81,920 MiB = 80 GiB
        (["--gpu-memory-gib", "32", "--peak-tflops", "125"], "custom", 32, 125),
        (["--device", "V100-32GB", "--gpu-memory-gib", "16"], "V100-32GB (memory overridden)", 16,
         125),
        (["--device", "H100 PCIe", "--gpu-memory-gib", "80"], "H100 PCIe", 80, 756),
    ]
    for extra, label, memory_gb, peak in cases:
        assert plan_cli.main([*DIMS, *extra, "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert (doc["device"], doc["cluster"]["gpu_memory_bytes"], doc["cluster"]["peak_tflops"]) \
            == (label, memory_gb * GIB, peak)
    with pytest.raises(SystemExit):
        plan_cli.main([*DIMS, "--device", "H100 PCIe"])
    assert "--device 'H100 PCIe' is no preset" in capsys.readouterr().err
    # --max-model uses no peak: a memory alone is fine there (the ZeRO Table 2 setting)
    assert plan_cli.main(["--max-model", "--gpu-memory-gib", "32", "--tp", "1", "--json"]) == 0


def test_cli_help_shows_defaults_and_every_flag_has_help():
    """Issue 13 item 18: --help showed no defaults and several flags had no help."""
    parser = plan_cli.build_parser()
    assert [a.dest for a in parser._actions if not a.help] == []
    text = " ".join(parser.format_help().split())
    for shown in ("tokens per training sample (hybrid.plan's default: the --model preset's own",
                  "else 1024)", "(default: 1.0)", "(default: 0.45)",
                  "(default: A100-80GB)", "(default: the --device preset's)",
                  "m = micro-batches per step per data-parallel rank"):
        assert shown in text, shown


@pytest.mark.parametrize("reserved", ["1", "0", "2.5"])
def test_cli_table_shows_the_reserve_and_explains_m(reserved, capsys):
    """Issue 13 item 18: 'total' included a 1 GB reserve no column showed; 'm' was unexplained.
    Every row's total is now the sum of the columns left of it."""
    assert plan_cli.main([*DIMS, "--reserved-gib", reserved, "--global-batch-size", "64"]) == 0
    lines = capsys.readouterr().out.splitlines()
    legend = next(x for x in lines if x.startswith("z = ZeRO stage"))
    assert "m = micro-batches per step (gradient accumulation: global batch / (b * dp))" in legend
    header = lines[lines.index(legend) + 1].split()
    assert header[5:14] == ["params", "grads", "master", "optim", "activ", "temps", "buffers",
                            "reserve", "total"]
    rows = [x.split() for x in lines[5:] if x.split() and x.split()[0].isdigit()]
    assert len(rows) == 4 * 4 * 9 - 4 * 5 + 2 * (4 * 3 * 9 - 3 * 5)  # as test_cli_json
    for r in rows:
        dp, m = int(r[1]), int(r[4])
        assert m == 64 // (4 * dp), r  # global batch / (micro-batch * dp)
        parts = [float(x) for x in r[5:13]]
        assert parts[7] == float(reserved) and abs(sum(parts) - float(r[13])) <= 0.04, r
        assert parts[5] > 0, r  # every layout has the loss's logits as temporaries


def test_cli_decimal_gb_flags_are_converted_to_gib(capsys):
    """--gpu-memory-gb / --reserved-gb are GB (10^9 bytes): 80 GB is 74.51 GiB, not 80 GiB."""
    base = [*DIMS, "--device", "A100-80GB", "--json"]
    assert plan_cli.main([*base, "--gpu-memory-gb", "80", "--reserved-gb", "1"]) == 0
    in_gb = json.loads(capsys.readouterr().out)
    gib = 80e9 / GIB
    assert plan_cli.main([*base, "--gpu-memory-gib", f"{gib!r}",
                          "--reserved-gib", f"{1e9 / GIB!r}"]) == 0
    assert json.loads(capsys.readouterr().out) == in_gb
    assert plan_cli.main([*base, "--gpu-memory-gib", "80"]) == 0
    assert json.loads(capsys.readouterr().out) != in_gb


@pytest.mark.parametrize("pair", [("--gpu-memory-gib", "--gpu-memory-gb"),
                                  ("--reserved-gib", "--reserved-gb"),
                                  ("--gpu-memory-gb", "--gpu-memory-gib")])
def test_cli_a_size_in_both_units_is_refused_naming_both(pair, capsys):
    """``--gpu-memory-gib 70 --gpu-memory-gb 80`` silently took the last one."""
    with pytest.raises(SystemExit) as exc:
        plan_cli.main([*DIMS, "--device", "H100", pair[0], "70", pair[1], "80"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {pair[1]}: not allowed with argument {pair[0]}" in err, err


def test_cli_size_metavars_name_their_unit():
    text = plan_cli.build_parser().format_help()
    for shown in ("--gpu-memory-gib GIB", "--gpu-memory-gb GB", "--reserved-gib GIB",
                  "--reserved-gb GB"):
        assert shown in text, shown
    assert "GPU_MEMORY_GB" not in text and "RESERVED_GB" not in text


def test_cli_a_batch_no_layout_divides_is_an_error_not_nothing_fits(capsys):
    """``--global-batch-size 100`` on 64 GPUs (dp 64/32/16/8) printed "best: nothing fits" and
    exited 0; memory was never the question."""
    with pytest.raises(SystemExit) as exc:
        plan_cli.main(["--model", "gpt3-1.3b", "--num-gpus", "64", "--global-batch-size", "100"])
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert "nothing fits" not in captured.out + captured.err
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and "no layout divides the batch: --global-batch-size must " \
        "be a multiple of --micro-batch-size * dp" in err, err
    assert "tp=8: global_batch_size=100 is not a multiple of micro_batch_size * dp = 1 * 8" in err
    # too big a model for the memory is an answer (exit 0), said as such
    assert plan_cli.main(["--model", "gpt3-175b", "--num-gpus", "8"]) == 0
    assert "best: nothing fits in memory" in capsys.readouterr().out


def test_output_into_a_closed_pipe_ends_quietly():
    """``hybrid.plan ... | head -8`` ended in a BrokenPipeError traceback."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    # the reader is gone before the planner's first line (it imports torch first)
    cmd = f"'{sys.executable}' -m hybrid.plan --model gpt3-13b --num-gpus 64 | true"
    out = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], cwd=root, capture_output=True,
                         text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(root)))
    assert out.returncode == 0 and out.stderr == "", out.stderr[-2000:]
