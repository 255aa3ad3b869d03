"""``--async-save`` (issue 27): training goes on while the shard is written; the next save, the
end of training and a stop wait for the pending one; the checkpoint is bitwise a synchronous
save's; a kill at three points of the background write leaves the previous checkpoint, and the
resume from it is exact (bitwise, dropout on: the MOCK model keeps the 0.1 defaults)."""

from __future__ import annotations

import pytest
import torch

from hybrid.checkpoint.directory import latest_iteration, list_iterations
from hybrid.checkpoint.shards import KINDS, CheckpointReader
from hybrid.dryrun.dry_run import dry_run
from hybrid.job.cli import parse_config
from hybrid.job.config_checks import validate
from hybrid.parallel.spawn import spawn_world
from tests.async_save_worlds import (
    async_events,
    killed_during_background_write,
    poll_on_the_host,
)
from tests.pretrain_worlds import run_configs
from tests.save_worlds import MOCK

POINTS = ("start", "midway", "written")


def losses(history) -> dict[int, float]:
    return {r["iteration"]: r["lm_loss"] for r in history if "split" not in r}


def assert_same_checkpoint(a: str, b: str, iteration: int) -> None:
    x, y = CheckpointReader(a, iteration), CheckpointReader(b, iteration)
    assert x.meta["train_state"] == y.meta["train_state"]
    assert x.meta["optimizer_step"] == y.meta["optimizer_step"] == iteration
    for name in x.param_names():
        for kind in KINDS:
            assert torch.equal(x.full_tensor(name, kind), y.full_tensor(name, kind)), (name, kind)
    for r in range(len(x.files)):
        rx, ry = x.rng_states(r), y.rng_states(r)
        assert rx.keys() == ry.keys() and all(torch.equal(rx[k], ry[k]) for k in rx)


@pytest.mark.timeout(600)
def test_background_saves_overlap_training_and_are_waited_for(tmp_path):
    a, s, t = (str(tmp_path / n) for n in ("async", "sync", "term"))
    run = MOCK + ["--train-iters", "6", "--save-interval", "2"]
    got = spawn_world(2, async_events, [run + ["--save", a, "--async-save"], run + ["--save", s],
                                        run + ["--save", t, "--async-save"]], 3, timeout_s=60)
    ((hist_a, ev), (hist_s, _), (hist_t, ev_t)), sizes = got[0]
    assert losses(hist_a) == losses(hist_s)  # saving in the background changes no number
    for it in (2, 4, 6):
        assert_same_checkpoint(a, s, it)
    pos = {e: i for i, e in enumerate(ev)}
    assert pos[("publish", 2)] > pos[("step", 3)]  # training went on during the write
    assert pos[("publish", 2)] < pos[("snapshot", 4)]  # the next save waited for it
    assert pos[("publish", 4)] < pos[("snapshot", 6)]
    assert ev[-1] == ("publish", 6) and latest_iteration(a) == 6  # the end waited
    # SIGTERM during step 3: the pending save of 2 and the stop's save of 3 are published
    assert max(losses(hist_t)) == 3 and ev_t[-1] == ("publish", 3)
    assert list_iterations(t) == [2, 3] and latest_iteration(t) == 3
    # the dry run reports the host snapshot rank 0 holds: its buffer less the RNG states
    buffer, fragments = sizes[0]
    assert all(s == sizes[0] for s in sizes) and 0 < buffer - fragments < 64 * 1024
    assert fragments >= 12 * 29_280 // 2  # fp32 master + 2 moments of its half (dp 2)
    dry = dry_run(validate(parse_config(run + ["--save", a, "--async-save",
                                               "--dry-run-world-size", "2"]), world_size=2), 0)
    assert dry["measured"]["async_save_snapshot"] == fragments


@pytest.mark.timeout(900)
def test_killed_during_background_write_resumes_exactly_from_the_previous(tmp_path):
    run = MOCK + ["--train-iters", "6", "--save-interval", "2", "--async-save"]
    dirs = {p: str(tmp_path / p) for p in POINTS}
    for point, ck in dirs.items():
        with pytest.raises(RuntimeError):
            spawn_world(2, killed_during_background_write, run + ["--save", ck], point,
                        timeout_s=30)
        assert latest_iteration(ck) == 2 and list_iterations(ck) == [2], point
        assert (tmp_path / point / "iter_0000002" / "metadata.json").is_file()
    assert (tmp_path / "midway" / "iter_0000004.tmp" / "rank_00000.safetensors.partial").is_file()
    assert sorted(p.name for p in (tmp_path / "written" / "iter_0000004.tmp").iterdir()) == [
        "rank_00000.safetensors", "rank_00001.safetensors"]
    plain = MOCK + ["--train-iters", "6"]
    full, *resumed = spawn_world(2, run_configs, [plain] + [
        run + ["--load", ck, "--save", ck] for ck in dirs.values()], timeout_s=60)[0]
    for point, history in zip(POINTS, resumed, strict=True):
        got, want = losses(history), losses(full)
        assert sorted(got) == [3, 4, 5, 6], point
        assert all(got[i] == want[i] for i in got), (point, got, want)  # bitwise
        assert latest_iteration(dirs[point]) == 6


def test_the_poll_agrees_on_the_host_without_touching_the_device():
    # rank 1 still writes at the first poll: nobody publishes; at the second everyone does
    assert spawn_world(2, poll_on_the_host, timeout_s=60) == [["wait", "publish"]] * 2
