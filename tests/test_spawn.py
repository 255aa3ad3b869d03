"""``spawn_world``'s rendezvous: rank 0 binds the store's port itself (a port found free by the
caller and bound later by rank 0 could be taken in between by a world started at the same
moment, as happened with two pytest workers), and a process group destroyed and initialised
again from the environment (as the job does once per run) comes up on that port."""

import gc
import os
import threading

import pytest
import torch
import torch.distributed as dist

from hybrid.parallel import spawn
from hybrid.parallel.spawn import spawn_world


def _sum_twice(rank: int, world: int) -> tuple[float, float, str]:
    first = torch.ones(1)
    dist.all_reduce(first)
    dist.destroy_process_group()
    gc.collect()
    dist.init_process_group("gloo")  # env://, rank 0 serving MASTER_PORT again
    again = torch.ones(1)
    dist.all_reduce(again)
    return first.item(), again.item(), os.environ["MASTER_PORT"]


@pytest.mark.timeout(120)
def test_worlds_started_at_once_rendezvous_apart_without_a_port_found_beforehand(monkeypatch):
    def no_free_port():
        raise AssertionError("spawn_world looked for a free port before its ranks bound one")

    monkeypatch.setattr(spawn, "free_port", no_free_port)
    results: dict[int, list] = {}

    def start(i):
        results[i] = spawn_world(2, _sum_twice, timeout_s=60)

    threads = [threading.Thread(target=start, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=110)
    assert sorted(results) == [0, 1, 2]
    ports = set()
    for world in results.values():
        assert [r[:2] for r in world] == [(2.0, 2.0)] * 2
        assert len({r[2] for r in world}) == 1  # one store per world, every rank on it
        ports.add(world[0][2])
    assert len(ports) == 3
