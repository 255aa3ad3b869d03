"""``--profile --profile-step-start S --profile-step-end E --profile-ranks R`` writes a
torch.profiler trace of iterations S to E - 1 of rank R, in ``<--tensorboard-dir>/../torch_profile``
(issue 36), readable as a Chrome/TensorBoard trace."""

from __future__ import annotations

import gzip
import json
import re

import pytest

from hybrid.job.cli import parse_config
from hybrid.job.config_checks import ConfigError, validate
from hybrid.parallel.spawn import spawn_world
from tests.pretrain_worlds import run_configs

ARGV = ["--mock-data", "--vocab-size", "128", "--num-layers", "1", "--hidden-size", "32",
        "--num-attention-heads", "2", "--seq-length", "16", "--micro-batch-size", "1",
        "--global-batch-size", "2", "--train-iters", "6", "--lr", "1e-3", "--log-interval", "1",
        "--eval-iters", "0", "--profile", "--use-pytorch-profiler", "--profile-step-start", "3",
        "--profile-step-end", "5"]


def steps_in(path) -> set[int]:
    with gzip.open(path, "rt") as f:
        trace = json.load(f)  # the Chrome trace format TensorBoard's profiler plugin reads
    assert trace["traceEvents"] and any(e.get("ph") == "X" for e in trace["traceEvents"])
    return {int(m.group(1)) for e in trace["traceEvents"]
            if (m := re.fullmatch(r"ProfilerStep#(\d+)", e.get("name", "")))}


@pytest.mark.timeout(300)
def test_the_trace_holds_exactly_the_asked_iterations_of_the_asked_rank(tmp_path):
    argv = ARGV + ["--tensorboard-dir", str(tmp_path / "tb"), "--profile-ranks", "1"]
    spawn_world(2, run_configs, [argv], timeout_s=120)
    traces = sorted((tmp_path / "torch_profile").iterdir())
    assert [p.name for p in traces] == ["rank-1.pt.trace.json.gz"]
    assert steps_in(traces[0]) == {3, 4}


def test_bad_profile_flags_are_refused_before_any_process_group():
    with pytest.raises(ConfigError, match="--profile-step-end.*must be > --profile-step-start 5"):
        parse_config(ARGV + ["--profile-step-end", "5", "--profile-step-start", "5"])
    with pytest.raises(ConfigError, match="--profile-ranks 2: not a global rank of this world"):
        validate(parse_config(ARGV + ["--profile-ranks", "0", "2"]), world_size=2)


def _run(profiler, iterations) -> None:
    import torch

    for it in iterations:
        profiler.begin(it)
        torch.ones(4).sum()
        profiler.end_iteration(it)
    profiler.close()


def test_a_run_resumed_inside_the_window_traces_the_rest_of_it(tmp_path):
    from hybrid.torch_profile import IterationProfiler

    lines = []
    first = IterationProfiler(3, 6, 0, tmp_path / "in")
    _run(first, range(1, 5))  # stopped after iteration 4 (--exit-interval 4)
    resumed = IterationProfiler(3, 6, 0, tmp_path / "in", print_fn=lines.append)
    _run(resumed, range(5, 9))  # --load of iteration 4: the first iteration is 5
    assert steps_in(resumed.path) == {5} and steps_in(first.path) == {3, 4}  # both kept
    assert resumed.path.name == "rank-0.iterations-5-5.pt.trace.json.gz"
    assert lines == [f" profiler: iteration 5 of rank 0 traced to {resumed.path} (torch.profiler, "
                     "Chrome/TensorBoard format); the run resumed at iteration 5, inside the "
                     "window --profile-step-start 3 .. --profile-step-end 6: iterations 3-4 ran "
                     "before the resume (not in the trace)"]
    after = IterationProfiler(3, 6, 1, tmp_path / "after", print_fn=lines.append)
    _run(after, range(6, 8))
    assert after.path is None and lines[1:] == [
        " profiler: the run resumed at iteration 6, after --profile-step-start 3 .. "
        "--profile-step-end 6: rank 1 traces nothing"]
    whole = IterationProfiler(3, 6, 0, tmp_path / "whole", print_fn=lines.append)
    _run(whole, range(1, 8))
    assert steps_in(whole.path) == {3, 4, 5}
    assert lines[2:] == [f" profiler: iterations 3-5 of rank 0 traced to {whole.path} "
                         "(torch.profiler, Chrome/TensorBoard format)"]
