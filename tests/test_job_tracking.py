"""Metrics and tracking around resumes and bad networks (issue 13 items 6, 8, 9)."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from hybrid.checkpoint.directory import latest_iteration, read_metadata
from hybrid.metrics import MetricsWriter
from hybrid.parallel.spawn import spawn_world
from hybrid.plot_metrics import read_metrics, run_labels
from tests.pretrain_worlds import run_configs

ROOT = Path(__file__).resolve().parents[1]


def test_readers_keep_the_latest_record_per_iteration(tmp_path):
    # crashed after 7 (last checkpoint at 4), resumed from 4 and crashed again after 6:
    # 1..7 then 5..6 in one file; the first launch's 7 and its eval at 6 are not the job's history
    lines = [dict(kind="start", iteration=0)]
    lines += [dict(kind="train", iteration=i, lm_loss=10.0 - i) for i in range(1, 8)]
    lines += [dict(kind="eval", split="valid", iteration=4, lm_loss=7.0),
              dict(kind="eval", split="valid", iteration=6, lm_loss=99.0)]
    lines += [dict(kind="start", iteration=4)]
    lines += [dict(kind="train", iteration=i, lm_loss=20.0 - i) for i in range(5, 7)]
    path = tmp_path / "metrics.jsonl"

    def write(records):
        path.write_text("".join(json.dumps(r) + "\n" for r in records))

    write(lines)
    train, evals = read_metrics(path)
    assert [(r["iteration"], r["lm_loss"]) for r in train] == [
        (1, 9.0), (2, 8.0), (3, 7.0), (4, 6.0), (5, 15.0), (6, 14.0)]
    assert [(r["iteration"], r["lm_loss"]) for r in evals] == [(4, 7.0)]
    # a file without start records (older versions): the latest record per iteration wins
    write([r for r in lines if r["kind"] != "start"])
    train, evals = read_metrics(path)
    assert [r["lm_loss"] for r in train] == [9.0, 8.0, 7.0, 6.0, 15.0, 14.0, 3.0]
    assert [(r["iteration"], r["lm_loss"]) for r in evals] == [(4, 7.0), (6, 99.0)]
    # a fresh run reusing the file: the older run's records stay in it but are not read
    write(lines + [dict(kind="start", iteration=0), dict(kind="train", iteration=1, lm_loss=1.5)])
    train, evals = read_metrics(path)
    assert [(r["iteration"], r["lm_loss"]) for r in train] == [(1, 1.5)] and evals == []
    assert len(path.read_text().splitlines()) == len(lines) + 2


def test_a_torn_last_line_stays_its_own_line_and_is_skipped_with_a_warning(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps(dict(kind="train", iteration=1, lm_loss=5.0))
                    + '\n{"kind": "train", "itera')
    w = MetricsWriter(0, str(path), {}, print_fn=lambda *_: None, start_iteration=1)
    w.close()  # a launch that logged nothing (it failed before training) adds no start record
    assert path.read_text().endswith('"itera\n')
    w = MetricsWriter(0, str(path), {}, print_fn=lambda *_: None, start_iteration=1)
    w.eval(dict(split="valid", iteration=1, lm_loss=4.0))
    w.close()
    lines = path.read_text().splitlines()
    assert len(lines) == 4 and json.loads(lines[2]) == {"kind": "start", "iteration": 1}
    with pytest.warns(UserWarning, match=r"metrics.jsonl:2: not a JSON record .*; skipped"):
        train, evals = read_metrics(path)
    assert [r["lm_loss"] for r in train + evals] == [5.0, 4.0]
    path.write_text("iteration 1 | lm loss 5.0\n")
    with pytest.raises(ValueError, match="metrics.jsonl:1: not a JSON record"):
        read_metrics(path)
    path.write_text("")
    with pytest.raises(ValueError, match="metrics.jsonl: no metrics records"):
        read_metrics(path)


def test_a_run_stopped_before_its_first_record_leaves_no_empty_metrics_file(tmp_path):
    """A job stopped (or failed) before its first log line left an empty ``--metrics-file``;
    one that existed before stays, as it was."""
    path = tmp_path / "m.jsonl"
    w = MetricsWriter(0, str(path), {}, print_fn=lambda *_: None)
    assert path.exists()  # opened at start: an unwritable path fails before training
    w.close()
    assert not path.exists()
    path.write_text("")
    MetricsWriter(0, str(path), {}, print_fn=lambda *_: None).close()
    assert path.read_text() == ""
    path.unlink()
    w = MetricsWriter(0, str(path), {}, print_fn=lambda *_: None)
    w.eval(dict(split="valid", iteration=0, lm_loss=4.0))
    w.close()
    assert len(path.read_text().splitlines()) == 2


def test_plot_labels_tell_files_of_the_same_name_apart():
    assert run_labels(["a/m.jsonl", "b/n.jsonl"]) == ["m", "n"]
    assert run_labels(["runs/a/metrics.jsonl", "runs/b/metrics.jsonl"]) == ["a/metrics",
                                                                            "b/metrics"]
    assert run_labels(["x/m.jsonl", "x/m.jsonl"]) == ["x/m.jsonl", "x/m.jsonl #2"]
    assert run_labels(["x/m.jsonl", "x/m.old"]) == ["m.jsonl", "m.old"]


MOCK = ["--mock-data", "--vocab-size", "500", "--num-layers", "1", "--hidden-size", "32",
        "--num-attention-heads", "2", "--seq-length", "16", "--micro-batch-size", "2",
        "--log-interval", "1", "--eval-iters", "0", "--wandb-project", "resume", "--min-lr", "1e-5"]


@pytest.mark.timeout(200)
def test_resumed_job_continues_its_wandb_run_and_writes_a_compact_header(tmp_path, capfd,
                                                                         monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    ck, wb, metrics = tmp_path / "ck", tmp_path / "wb", tmp_path / "m" / "metrics.jsonl"
    extra = ["--save", str(ck), "--load", str(ck), "--use-checkpoint-opt_param-scheduler",
             "--wandb-save-dir", str(wb), "--metrics-file",
             str(metrics)]
    spawn_world(1, run_configs,
                [MOCK + extra + ["--train-iters", "2"], MOCK + extra + ["--train-iters", "4"]],
                timeout_s=60)
    out = capfd.readouterr().out
    run_id = read_metadata(ck, latest_iteration(ck))["wandb_run_id"]
    # one folder per launch, each logging the same run; wandb appends "-1" to the folder's name
    # when both launches start within the same second, so the run id is read from the log file's
    # name
    runs = sorted((wb / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all((r / f"run-{run_id}.wandb").is_file() for r in runs), (runs,
                                                                                         run_id)
    # start-up: two header lines before the first iteration, no JSON dump, no empty traffic
    head = [line.strip() for line in out.split(" iteration ")[0].splitlines() if line.strip()]
    assert len(head) == 3 and head[0].startswith("hybrid-zero pretraining |"), head
    assert head[0].endswith("| ZeRO-1 fp32 | activations: all kept"), head
    assert (head[1].startswith("no checkpoint under --load")
            and head[2].startswith("ZeRO stage 1 fp32")), head
    assert "moved last step" not in out and '"model": {' not in out
    train, _ = read_metrics(metrics)
    assert [r["iteration"] for r in train] == [1, 2, 3, 4]
    starts = [json.loads(line)["iteration"] for line in metrics.read_text().splitlines()
              if '"start"' in line]
    assert starts == [0, 2]
    config = json.loads((tmp_path / "m" / "metrics.config.json").read_text())
    assert config["training"]["train_iters"] == 4 and config["logging"]["wandb_project"] == "resume"


@pytest.mark.timeout(200)
def test_a_resume_at_a_smaller_global_batch_sizes_its_dataset_from_the_consumed_samples(tmp_path):
    # 3 iterations at global batch 4 consume 12 samples; 3 more at global batch 2 need 18, more than
    # train_iters x global batch = 12 (the dataset's size before, which ended the run with an error)
    ck = str(tmp_path / "ck")
    common = MOCK + ["--save", ck, "--load", ck, "--lr-decay-style", "constant"]
    first, resumed = spawn_world(1, run_configs,
                                 [common + ["--train-iters", "3", "--micro-batch-size", "4"],
                                                  common + ["--train-iters", "6"]], timeout_s=60)[0]
    assert ([(r["iteration"], r["consumed_samples"]) for r in resumed if "split" not in r]
            == [(4, 14), (5, 16), (6, 18)])
    assert all(math.isfinite(r["lm_loss"]) for r in first + resumed if "split" not in r)
    assert read_metadata(ck, latest_iteration(ck))["train_state"]["consumed_samples"] == 18


class SilentServer:
    """Accepts TCP connections on 127.0.0.1 and never answers (a server that does not respond)."""

    def __enter__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port, self.conns = self.sock.getsockname()[1], []
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def _accept(self):
        while True:
            try:
                self.conns.append(self.sock.accept()[0])
            except OSError:
                return

    def __exit__(self, *exc):
        self.sock.close()
        for c in self.conns:
            c.close()


WANDB_CHILD = """
import sys, time
from hybrid.metrics import MetricsWriter
t = time.monotonic()
w = MetricsWriter(0, None, {"a": 1}, "p", None, sys.argv[1], wandb_init_timeout=3)
print(w.wandb_run_id is not None, w._wandb.settings.mode, round(time.monotonic() - t, 1))
w.eval({"split": "valid", "iteration": 1, "lm_loss": 2.0})
w.close()
"""


@pytest.mark.timeout(200)
def test_unreachable_wandb_server_falls_back_to_offline_quickly(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    with SilentServer() as server:
        env.update(PYTHONPATH=str(ROOT), HOME=str(tmp_path), WANDB_API_KEY="x" * 40,
                   WANDB_BASE_URL=f"http://127.0.0.1:{server.port}")
        out = subprocess.run([sys.executable, "-c", WANDB_CHILD, str(tmp_path / "wb")], env=env,
                             capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stderr[-2000:]
    started, mode, seconds = out.stdout.splitlines()[0].split()  # then the logged eval line
    assert (started, mode) == ("True", "offline") and float(seconds) < 60, out.stdout
    assert "could not reach its server within --wandb-init-timeout 3 s" in out.stderr
    assert len(list((tmp_path / "wb" / "wandb").glob("offline-run-*"))) == 1
