"""``--init-from-hf`` before any process group (one process, no spawn): every config.json
difference at once with the flag line to paste, the tie wording, the dropout note, and the
weight files (none, pickle only, a shard the index lists but the directory lacks)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from test_hf_llama import FAMILIES, MODEL, random_hf  # noqa: E402

from hybrid.hf.llama_config import llama_config_dict  # noqa: E402
from hybrid.job.cli import parse_config  # noqa: E402
from hybrid.job.config_checks import ConfigError, validate  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RUN = ["--mock-data", "--seq-length", "32", "--micro-batch-size", "2", "--train-iters", "2"]
PLAIN = ["--num-layers", "3", "--hidden-size", "64", "--num-attention-heads", "4",
         "--vocab-size", "400"]  # a plain GPT: differs from each family in many settings


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf_preflight")
    for i, family in enumerate(FAMILIES):
        random_hf(family, d / family, seed=i)
    return d


def refusal(argv: list[str]) -> str:
    with pytest.raises(ConfigError) as e:
        validate(parse_config(argv), world_size=2)
    return str(e.value)


def test_every_difference_at_once_then_the_pasted_flag_line_is_accepted(dirs):
    from hybrid.hf.weights import start_note

    for family in FAMILIES:
        where = f"--init-from-hf {dirs / family}"
        lines = refusal(PLAIN + RUN + ["--init-from-hf", str(dirs / family)]).splitlines()
        diffs = [x for x in lines if x.startswith("  config.json has")]
        assert lines[0] == (f"{where}: this run's model differs from config.json in "
                            f"{len(diffs)} settings:"), lines
        assert lines[1:-2] == diffs and len(diffs) >= 8, lines
        assert lines[-2].startswith("  the model flags that reproduce config.json")
        flags = shlex.split(lines[-1])
        assert "--attention-dropout" in flags and "--hidden-dropout" in flags
        job = validate(parse_config(flags + RUN + ["--init-from-hf", str(dirs / family)]),
                       world_size=2)
        assert (job.gpt.attention_dropout, job.gpt.hidden_dropout) == (0.0, 0.0)
        assert start_note(dirs / family, job.gpt) is None
    assert ("  config.json has num_hidden_layers 2, this run 3: give --num-layers 2"
            in refusal(PLAIN + RUN + ["--init-from-hf", str(dirs / "llama")]))


def test_the_tie_setting_is_worded_as_the_flag_to_add_or_drop(dirs):
    llama = FAMILIES["llama"][2]
    model = [x for x in llama if x != "--untie-embeddings-and-output-weights"]
    text = refusal(MODEL + model + RUN + ["--init-from-hf", str(dirs / "llama")])
    assert text.splitlines()[1] == ("  config.json has tie_word_embeddings false (untied): add "
                                    "--untie-embeddings-and-output-weights"), text
    assert "this run's model differs from config.json in 1 setting:" in text
    qwen3 = FAMILIES["qwen3"][2] + ["--untie-embeddings-and-output-weights"]
    text = refusal(MODEL + qwen3 + RUN + ["--init-from-hf", str(dirs / "qwen3")])
    assert text.splitlines()[1] == (
        "  config.json has tie_word_embeddings true (tied): drop "
        "--untie-embeddings-and-output-weights (over a --preset: give "
        "--no-untie-embeddings-and-output-weights)"), text


def test_megatron_dropout_defaults_stay_and_are_noted_once_at_start(dirs):
    from hybrid.hf.weights import start_note

    argv = MODEL + FAMILIES["llama"][2] + RUN + ["--init-from-hf", str(dirs / "llama")]
    job = validate(parse_config(argv), world_size=2)
    assert (job.gpt.attention_dropout, job.gpt.hidden_dropout) == (0.1, 0.1)  # Megatron-LM's
    note = start_note(dirs / "llama", job.gpt)
    assert "--attention-dropout 0.1 --hidden-dropout 0.1 (Megatron-LM's defaults)" in note
    assert "config.json has attention_dropout 0.0" in note and "0 and 0" in note
    assert llama_config_dict(job.gpt)["attention_dropout"] == 0.1  # export: the run's value
    out = subprocess.run([sys.executable, "-m", "hybrid.pretrain", *argv, "--zero-stage", "1",
                          "--dry-run-world-size", "2"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0, out.stderr[-2000:]
    assert [x for x in out.stdout.splitlines() if "note:" in x] == [note]


def _broken(dirs: Path, tmp: Path) -> dict[str, tuple[Path, str]]:
    """Three directories whose weights cannot load -> (directory, the message's tail)."""
    valid = ("valid: model.safetensors, or model.safetensors.index.json with every shard it "
             "lists")
    none, pickled, shard = tmp / "none", tmp / "pickle", tmp / "shard"
    for d in (none, pickled, shard):
        d.mkdir()
        (d / "config.json").write_text((dirs / "llama" / "config.json").read_text())
    torch.save({"w": torch.ones(1)}, pickled / "pytorch_model.bin")
    index = json.loads((dirs / "llama" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    (shard / "model.safetensors.index.json").write_text(json.dumps(index))
    for f in files[:1] + files[2:]:
        (shard / f).write_bytes((dirs / "llama" / f).read_bytes())
    return {"none": (none, f"{none} has no weights (it holds config.json); {valid}"),
            "pickle": (pickled, f"{pickled} holds pickle weights only (pytorch_model.bin), "
                                f"which are not loaded (unpickling runs code); {valid}"),
            "shard": (shard, f"{shard}: model.safetensors.index.json lists {files[1]}, not in "
                             f"the directory (1 of {len(files)} shards missing); {valid}")}


def test_weight_files_are_checked_before_any_process_group(dirs, tmp_path):
    flags = MODEL + FAMILIES["llama"][2] + RUN
    for name, (d, message) in _broken(dirs, tmp_path).items():
        text = refusal(flags + ["--init-from-hf", str(d)])
        assert text.startswith(f"--init-from-hf {message}"), (name, text)
    (tmp_path / "launch").mkdir()
    d, message = _broken(dirs, tmp_path / "launch")["shard"]
    out = subprocess.run([sys.executable, "-m", "hybrid.pretrain", "--nproc-per-node", "2",
                          *flags, "--init-from-hf", str(d)], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 2 and out.stdout == "", (out.stdout, out.stderr)
    assert out.stderr.splitlines() == [f"hybrid-pretrain: error: --init-from-hf {message}"]
