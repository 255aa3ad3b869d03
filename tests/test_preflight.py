"""Pre-flight checks of the paths a job writes (issue 27 kinds 3 and 7): each unusable path is
refused before any process group starts, naming the path and the flag that moves it, and
read-only data works with ``--data-cache-path``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid.job.cli import parse_config
from hybrid.job.config_checks import ConfigError, validate
from tests.pretrain_worlds import MODEL, prepare_data

ROOT = Path(__file__).resolve().parents[1]
MOCK = ["--mock-data", "--vocab-size", "512", "--num-layers", "1", "--hidden-size", "32",
        "--num-attention-heads", "2", "--seq-length", "16", "--train-iters", "2",
        "--eval-iters", "0"]


def refusal(argv: list[str]) -> str:
    with pytest.raises(ConfigError) as e:
        validate(parse_config(argv), world_size=1, local_world_size=1)
    return str(e.value)


def test_every_unwritable_output_path_is_refused_naming_it_and_its_flag(tmp_path):
    # kind 3: --save under a regular file or in /proc was found at the first save
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    assert refusal(MOCK + ["--save", f"{blocker}/ck"]) == (
        f"--save {blocker}/ck cannot be written: {blocker} is a file, not a directory; give "
        "--save a writable directory")
    assert refusal(MOCK + ["--save", "/proc/ck"]).startswith("--save /proc/ck cannot be written: ")
    assert refusal(MOCK + ["--save", str(blocker)]).startswith(
        f"--save {blocker} cannot be written: it is a file, not a directory")
    assert refusal(MOCK + ["--metrics-file", str(tmp_path)]).startswith(
        f"--metrics-file {tmp_path} cannot be written: it is a directory")
    assert refusal(MOCK + ["--metrics-file", f"{blocker}/m.jsonl"]).startswith("--metrics-file ")
    assert refusal(MOCK + ["--tensorboard-dir", f"{blocker}/tb"]).startswith("--tensorboard-dir ")
    assert refusal(MOCK + ["--wandb-project", "p", "--wandb-save-dir", "/proc/w"]).startswith(
        "--wandb-save-dir /proc/w cannot be written: ")
    # writable paths pass, and nothing is left behind by the probes
    validate(parse_config(MOCK + ["--save", str(tmp_path / "new" / "ck"), "--metrics-file",
                                  str(tmp_path / "m.jsonl")]), world_size=1, local_world_size=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]
    # through the launcher: one line, before torchrun starts
    out = subprocess.run([sys.executable, "-m", "hybrid.pretrain", "--nproc-per-node", "2", *MOCK,
                          "--save", "/proc/ck"], cwd=ROOT, capture_output=True, text=True,
                         timeout=100, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 2 and (out.stdout + out.stderr).splitlines() == [
        f"hybrid-pretrain: error: {refusal(MOCK + ['--save', '/proc/ck'])}"]


def _read_only(directory: Path, cmd: list[str]) -> list[str]:
    """``cmd`` run with ``directory`` mounted read-only (a private mount namespace)."""
    return ["unshare", "-rm", "sh", "-c", 'mount --bind -o ro "$0" "$0" && exec "$@"',
            str(directory), *cmd]


@pytest.mark.timeout(300)
def test_read_only_data_directory_is_refused_at_once_and_runs_with_data_cache_path(tmp_path):
    # kind 7: the index cache beside read-only data failed on every rank after the groups started
    data = tmp_path / "shared"
    data.mkdir(parents=True)
    prefix, tok = prepare_data(data)
    probe = subprocess.run(_read_only(data, ["touch", str(data / "x")]), capture_output=True)
    if probe.returncode == 0 or b"Read-only" not in probe.stderr:
        pytest.skip(f"no read-only bind mount here (unshare -rm): {probe.stderr[-200:]!r}")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    job = MODEL + ["--data-path", prefix, "--tokenizer-model", tok, "--split", "1",
                   "--micro-batch-size", "2", "--train-iters", "2", "--eval-iters", "0"]
    launcher = [sys.executable, "-m", "hybrid.pretrain"]
    out = subprocess.run(_read_only(data, [*launcher, "--nproc-per-node", "2", *job]), cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=100)
    lines = (out.stdout + out.stderr).splitlines()
    cache = data / "cache" / "GPTDataset_indices"
    assert out.returncode == 2 and len(lines) == 1, lines[-30:]
    assert lines[0].startswith(
        f"hybrid-pretrain: error: the data index cache {cache} (default: beside --data-path) "
        "cannot be written: Read-only file system"), lines
    assert "-GPTDataset-train-doc.npy this job needs; give --data-cache-path DIR" in lines[0]
    assert "give --data-cache-path DIR" in lines[0]
    moved = tmp_path / "index-cache"
    out = subprocess.run(_read_only(data, [*launcher, *job, "--data-cache-path", str(moved)]),
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=200)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert " iteration        2/" in out.stdout
    assert list(moved.glob("*-GPTDataset-train-*.npy")) and not cache.exists()


def test_a_read_only_index_cache_is_read_when_it_holds_every_index_the_job_needs(
        tmp_path, monkeypatch):
    # kind 7: a read-only --data-cache-path holding the right indices was refused, and a
    # read-only default cache holding other indices passed, then crashed inside the ranks
    from hybrid.job import preflight
    from hybrid.job.datasets import build_datasets

    data, given = tmp_path / "shared", tmp_path / "indices"
    data.mkdir()
    prefix, tok = prepare_data(data)
    default = data / "cache" / "GPTDataset_indices"
    job = MODEL + ["--data-path", prefix, "--tokenizer-model", tok, "--split", "1",
                   "--micro-batch-size", "2", "--eval-iters", "0"]
    read_only, writable = set(), preflight.unwritable
    monkeypatch.setattr(preflight, "unwritable", lambda p, is_dir=True: (
        "Read-only file system" if Path(p) in read_only else writable(p, is_dir)))

    def checked(*extra):
        return validate(parse_config(job + list(extra)), world_size=1, local_world_size=1)

    for cache, flag in ((given, ["--data-cache-path", str(given)]), (default, [])):
        build_datasets(checked("--train-iters", "2", *flag))  # built while writable
        built = sorted(cache.iterdir())
        read_only.add(cache)
        checked("--train-iters", "2", *flag)  # holds every index: read as it is
        why = refusal(job + ["--train-iters", "3", *flag])  # other sample counts: other indices
        assert sorted(cache.iterdir()) == built  # the check wrote nothing
        head = (f"--data-cache-path {given}" if flag else
                f"the data index cache {default} (default: beside --data-path)")
        assert why.startswith(f"{head} cannot be written: Read-only file system; it lacks the "
                              "index "), why
        assert why.split(" lacks the index ")[1].split()[0].endswith("-GPTDataset-train-doc.npy")
        assert "--data-cache-path" in why.split(";")[2], why
        read_only.clear()


@pytest.mark.timeout(300)
def test_the_read_only_cache_check_sizes_a_resumed_job_from_its_checkpoint(tmp_path, monkeypatch):
    """A resumed job's training split holds its consumed samples plus the rest at this run's
    global batch, so it needs other indices than a fresh run of the same flags: the check sized
    them for a fresh run, passed, and the ranks then failed on the read-only cache."""
    from hybrid.job import preflight
    from hybrid.job.datasets import build_datasets
    from hybrid.parallel.spawn import spawn_world
    from tests.pretrain_worlds import run_configs

    data, cache, ck = tmp_path / "data", tmp_path / "indices", tmp_path / "ck"
    data.mkdir()
    prefix, tok = prepare_data(data)
    job = MODEL + ["--data-path", prefix, "--tokenizer-model", tok, "--split", "1",
                   "--micro-batch-size", "2", "--eval-iters", "0", "--data-cache-path",
                   str(cache), "--lr", "1e-3", "--lr-decay-style", "constant"]
    spawn_world(1, run_configs, [job + ["--global-batch-size", "8", "--train-iters", "2",
                                        "--save", str(ck)]], timeout_s=60)  # 16 samples
    resumed = job + ["--global-batch-size", "2", "--train-iters", "4", "--load", str(ck)]
    fresh = validate(parse_config(resumed[:-2]), world_size=1, local_world_size=1)
    build_datasets(fresh)  # a fresh run's indices (8 samples) are there; the resume needs 20
    monkeypatch.setattr(preflight, "unwritable", lambda p, is_dir=True: (
        "Read-only file system" if Path(p) == cache else None))
    validate(parse_config(resumed[:-2]), world_size=1, local_world_size=1)
    why = refusal(resumed)
    assert why.startswith(f"--data-cache-path {cache} cannot be written: Read-only file system; "
                          "it lacks the index "), why


def test_the_profile_trace_directory_is_checked_with_the_other_outputs(tmp_path, monkeypatch):
    # ./torch_profile in a read-only working directory failed after training (95 lines)
    profile = MOCK + ["--profile", "--profile-step-start", "1", "--profile-step-end", "2"]
    monkeypatch.chdir("/proc")  # not writable, even by root
    assert refusal(profile).startswith(
        "--profile writes its traces to /proc/torch_profile (in the working directory, without "
        "--tensorboard-dir), which cannot be written: ")
    assert refusal(profile).endswith("; give --tensorboard-dir DIR with a writable parent (the "
                                     "traces go to DIR/../torch_profile), or run from a writable "
                                     "directory")
    validate(parse_config(profile + ["--tensorboard-dir", str(tmp_path / "tb")]), world_size=1,
             local_world_size=1)  # beside a writable --tensorboard-dir
    validate(parse_config(MOCK + ["--profile", "--profile-step-start", "3", "--profile-step-end",
                                  "4"]), world_size=1, local_world_size=1)  # after the last
