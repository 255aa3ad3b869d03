"""The checkpoint-format door (issue 42 item 2): a format is one module.

``plain_test`` (tests/plain_format.py) is a second format written only in the tests. Registered,
it saves and loads through the door with nothing of the job, the async saver or consolidation
changed for it: a 2-rank run resumes from it bitwise (synchronous save and ``--async-save``), its
``metadata.json`` names it, and consolidation and Hugging Face export read it into the same
tensors as the default format's checkpoint of the same iteration. Right values: bitwise-equal
training losses and tensors.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hybrid.checkpoint.published import IncompleteCheckpointError
from hybrid.checkpoint.registry import FORMATS, format_of, open_checkpoint
from hybrid.parallel.spawn import spawn_world
from tests.plain_format import PLAIN, PlainReader, plain_world

MOCK = ["--mock-data", "--vocab-size", "1000", "--num-layers", "2", "--hidden-size", "64",
        "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2",
        "--global-batch-size", "16", "--hidden-dropout", "0.1", "--attention-dropout", "0.1",
        "--lr", "3e-3", "--min-lr", "3e-4", "--lr-warmup-iters", "2", "--lr-decay-iters", "8",
        "--log-interval", "1", "--eval-iters", "0", "--seed", "5", "--zero-stage", "2"]


def train_losses(history) -> dict[int, float]:
    return {r["iteration"]: r["lm_loss"] for r in history if "split" not in r}


@pytest.mark.timeout(600)
def test_a_format_written_only_in_a_test_saves_resumes_and_consolidates(tmp_path, monkeypatch):
    from hybrid.checkpoint.consolidate import consolidate
    from hybrid.hf.export import export_hf

    plain = ["--ckpt-format", "plain_test"]
    sync, background, ref = (str(tmp_path / n) for n in ("ck_sync", "ck_async", "ck_ref"))
    argvs = [MOCK + ["--train-iters", "6"],
             MOCK + plain + ["--train-iters", "3", "--save", sync],
             MOCK + ["--train-iters", "6", "--load", sync],  # the format from metadata.json
             MOCK + plain + ["--train-iters", "3", "--save", background, "--async-save",
                             "--save-interval", "2"],
             MOCK + ["--train-iters", "6", "--load", background],
             MOCK + ["--train-iters", "3", "--save", ref]]  # the default format
    straight, *runs = map(train_losses, spawn_world(2, plain_world, argvs, timeout_s=400)[0])
    for first, resumed in (runs[0:2], runs[2:4]):
        assert first == {i: straight[i] for i in (1, 2, 3)}
        assert resumed == {i: straight[i] for i in (4, 5, 6)}  # bitwise
    assert runs[4] == runs[0]

    for ck in (sync, background):
        d = Path(ck) / "iter_0000003"
        meta = json.loads((d / "metadata.json").read_text())
        assert meta["ckpt_format"] == "plain_test" and "format_version" not in meta
        assert sorted(p.name for p in d.iterdir()) == ["metadata.json", "plain_0.safetensors",
                                                       "plain_1.safetensors"]
    assert json.loads((Path(ref) / "iter_0000003" / "metadata.json").read_text())[
        "ckpt_format"] == "safetensors"

    # unknown in this process until registered: refused by name
    with pytest.raises(IncompleteCheckpointError, match="format 'plain_test', which this code "
                                                        "does not read; it reads: safetensors"):
        open_checkpoint(sync)
    monkeypatch.setitem(FORMATS, PLAIN.name, PLAIN)
    assert isinstance(open_checkpoint(sync), PlainReader)
    for tool, out in ((consolidate, "model.safetensors"), (export_hf, "hf")):
        tool(sync, str(tmp_path / f"plain_{out}"))
        tool(ref, str(tmp_path / f"ref_{out}"))
    for plain_file, ref_file in ((tmp_path / "plain_model.safetensors",
                                  tmp_path / "ref_model.safetensors"),
                                 (tmp_path / "plain_hf" / "model.safetensors",
                                  tmp_path / "ref_hf" / "model.safetensors")):
        got, want = load_file(plain_file), load_file(ref_file)
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want), plain_file


def test_metadata_names_its_format_and_older_checkpoints_are_the_default_one(tmp_path):
    """``metadata.json`` written before the door has ``format_version`` and no format name: it is
    the default format's, read by version as before; another format is refused by its name
    (Megatron-LM's own ``metadata.json`` says ``sharded_backend``)."""
    where = tmp_path / "metadata.json"
    assert format_of({"format_version": 2}, where).name == "safetensors"
    assert format_of({"format_version": 1}, where).name == "safetensors"
    assert format_of({"ckpt_format": "safetensors", "format_version": 2}, where).name == \
        "safetensors"
    with pytest.raises(IncompleteCheckpointError, match=r"format version 7, this code reads "
                                                        r"versions \(1, 2\)"):
        format_of({"format_version": 7}, where)
    for meta, name in (({"sharded_backend": "torch_dist", "sharded_backend_version": 1},
                        "torch_dist"), ({"ckpt_format": "zarr"}, "zarr"), ({}, None)):
        with pytest.raises(IncompleteCheckpointError, match=f"format {name!r}, which this code "
                                                            "does not read"):
            format_of(meta, where)


@pytest.mark.parametrize("pointer", ["10", "release"])
def test_a_megatron_legacy_checkpoint_is_named_with_the_way_in(tmp_path, pointer):
    """Megatron-LM's legacy layout (``iter_N/mp_rank_00/model_optim_rng.pt``, or its ``release``
    pointer) is refused as that format, with how to start from its weights, rather than as one
    of our saves that did not finish."""
    d = tmp_path / ("release" if pointer == "release" else "iter_0000010") / "mp_rank_00"
    d.mkdir(parents=True)
    (d / "model_optim_rng.pt").write_bytes(b"not read")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text(pointer + "\n")
    with pytest.raises(IncompleteCheckpointError) as e:
        open_checkpoint(tmp_path)
    assert "legacy format" in str(e.value) and "--init-from-hf" in str(e.value)
    assert "did not finish" not in str(e.value)
