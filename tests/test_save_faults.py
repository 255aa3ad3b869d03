"""Faults around the save directory: a full disk during a save (issue 27, kind 4)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybrid.checkpoint.directory import latest_iteration, list_iterations
from hybrid.parallel.spawn import spawn_world
from tests.save_worlds import MOCK, disk_full_on


@pytest.mark.timeout(300)
def test_disk_full_removes_the_partial_save_and_names_path_and_errno(tmp_path):
    ck = tmp_path / "ck"
    save = ["--save", str(ck)]
    got = spawn_world(2, disk_full_on, MOCK + ["--train-iters", "3"] + save,
                      MOCK + ["--train-iters", "6", "--load", str(ck)] + save, 1, timeout_s=60)
    partial = ck / "iter_0000006.tmp" / "rank_00001.safetensors.partial"
    for message in got:  # every rank raised (none waits for the failed one), the same account
        assert message.startswith("errno=28 "), message
        assert "rank 1: errno 28 (ENOSPC)" in message and f"writing {partial}" in message
        assert f"removed the partial directory {ck / 'iter_0000006.tmp'}" in message
    assert not (ck / "iter_0000006.tmp").exists()
    assert latest_iteration(ck) == 3 and list_iterations(ck) == [3]
    assert (ck / "iter_0000003" / "metadata.json").is_file()
    assert sorted(p.name for p in Path(ck).iterdir()) == ["iter_0000003",
                                                         "latest_checkpointed_iteration.txt"]
