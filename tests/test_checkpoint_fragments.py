"""Partition-wise checkpoint shards read by overlap on other grids (one process, no spawn).

Shards are written exactly as ``save_checkpoint`` writes them (``shard_entries`` of each rank's
``PartitionLayout`` fragments), for tensors with every geometry the TP plan makes: a vocabulary
table padded along dim 0, a column-parallel weight, a row-parallel weight (split dim 1), a tensor
padded along a middle dimension, and a replicated bias. Every target (tp, dp) cut must come back
bitwise and read exactly its own real elements once.
"""

import json

import pytest
import torch
from safetensors import safe_open

from hybrid.checkpoint.directory import FORMAT_VERSION, publish, shard_name, staging_dir
from hybrid.checkpoint.shards import KINDS, CheckpointReader, shard_entries
from hybrid.checkpoint.stream import Entry, write_safetensors
from hybrid.consolidate import main as consolidate_main
from hybrid.parallel.tp_spec import TPSpec
from hybrid.zero.layout import PartitionLayout
from hybrid.zero.state import OwnedFragment

# name: (full shape, split dim, pad multiple per TP rank, unit)
PARAMS = {
    "wte.weight": ((50, 8), 0, 4, "root"),
    "layers.0.qkv.weight": ((12, 8), 0, 1, "layers.0"),
    "layers.0.fc2.weight": ((6, 12), 1, 1, "layers.0"),
    "layers.0.odd.weight": ((5, 10, 3), 1, 1, "layers.0"),
    "layers.0.ln.bias": ((7,), None, 1, "layers.0"),
}


def padded(full: int, tp: int, multiple: int) -> int:
    q = tp * multiple
    return -(-full // q) * q


def spec(name: str, tp: int, t: int) -> TPSpec:
    shape, split, mult, _ = PARAMS[name]
    if split is None:
        return TPSpec(None, shape, 0, t, tp)
    return TPSpec(split, shape, padded(shape[split], tp, mult), t, tp)


@pytest.fixture(scope="module")
def full():
    g = torch.Generator().manual_seed(0)
    return {k: {n: torch.randn(PARAMS[n][0], generator=g) for n in PARAMS} for k in KINDS}


def layout(tp: int, t: int, dp: int) -> PartitionLayout:
    entries = [(n, tuple(spec(n, tp, t).shard(torch.zeros(PARAMS[n][0])).shape),
                PARAMS[n][1] is None, False, PARAMS[n][3]) for n in PARAMS]
    return PartitionLayout(entries, ["root", "layers.0"], dp, align=2)


def owned(full, tp: int, t: int, dp: int, d: int) -> list[OwnedFragment]:
    """Rank (t, d)'s fragments with views into a full flat buffer (what stage 0 hands out)."""
    L = layout(tp, t, dp)
    flats = {k: torch.zeros(L.total_numel) for k in KINDS}
    for s in L.slots:
        for k in KINDS:
            flats[k][s.offset:s.offset
                     + s.numel] = spec(s.name, tp, t).shard(full[k][s.name]).reshape(-1)
    out = []
    for f in L.fragments(d):
        s = L.slots[f.slot]
        out.append(OwnedFragment(s, spec(s.name, tp, t), f.param_start, f.param_start + f.length,
                                 {k: flats[k][f.flat_offset:f.flat_offset + f.length]
                                  for k in KINDS}))
    return out


def write_checkpoint(root, full, tp: int, dp: int, version: int = FORMAT_VERSION) -> None:
    stage = staging_dir(root, 1)
    stage.mkdir(parents=True)
    for d in range(dp):
        for t in range(tp):
            if version == FORMAT_VERSION:
                entries, lay = shard_entries(owned(full, tp, t, dp, d), t)
            # format 1: equal dp cuts of every unpadded local tensor, replicated ones on every TP
            # rank
            else:
                entries, lay = [], {}
                for n in PARAMS:
                    sp = spec(n, tp, t)
                    real = [sp.shard(full[k][n]) for k in KINDS]
                    if not sp.replicated:
                        real = [r.narrow(sp.split_dim, 0, sp.real_local_size()) for r in real]
                    m = real[0].numel()
                    lo, hi = m * d // dp, m * (d + 1) // dp
                    lay[n] = dict(tp_rank=t, local_shape=list(real[0].shape), flat_range=[lo, hi])
                    entries += [Entry(f"{k}/{n}", torch.float32, (hi - lo,),
                                      lambda r=r, lo=lo, hi=hi: r.reshape(-1)[lo:hi])
                                for k, r in zip(KINDS, real, strict=True)]
            write_safetensors(stage / shard_name(t + tp * d), entries, {"layout": json.dumps(lay)})
    params = {n: dict(full_shape=list(PARAMS[n][0]), split_dim=PARAMS[n][1],
                      padded_size=spec(n, tp, 0).padded_size)
              for n in PARAMS}
    meta = dict(grid=dict(tp=tp, dp=dp, world_size=tp * dp), params=params, optimizer_step=3,
                zero_stage=2, model={})
    publish(root, 1, meta, tp * dp, None)
    if version != FORMAT_VERSION:
        p = root / "iter_0000001" / "metadata.json"
        p.write_text(p.read_text().replace(f'"format_version": {FORMAT_VERSION}',
                                           f'"format_version": {version}'))


def real_elements(tp: int, t: int, dp: int, d: int) -> int:
    """Unpadded elements of rank (t, d)'s partition (its share of a checkpoint, per kind)."""
    L = layout(tp, t, dp)
    n = 0
    for f in L.fragments(d):
        s = L.slots[f.slot]
        mask = torch.ones(s.shape)
        sp = spec(s.name, tp, t)
        if not sp.replicated:
            mask.narrow(sp.split_dim, sp.real_local_size(),
                        s.shape[sp.split_dim] - sp.real_local_size()).zero_()
        n += int(mask.reshape(-1)[f.param_start:f.param_start + f.length].sum())
    return n


@pytest.mark.parametrize("source", [(2, 2), (1, 3), (4, 1), (3, 2)])
@pytest.mark.parametrize("target", [(1, 3), (1, 4), (2, 1), (4, 1), (3, 2), (2, 2)])
def test_every_cut_reads_back_bitwise_and_only_its_share(tmp_path, full, source, target):
    write_checkpoint(tmp_path, full, *source)
    tp, dp = target
    for t in range(tp):
        for d in range(dp):
            reader = CheckpointReader(tmp_path)
            L = layout(tp, t, dp)
            for f in L.fragments(d):
                s = L.slots[f.slot]
                sp = spec(s.name, tp, t)
                for k in KINDS:
                    out = torch.full((f.length,), float("nan"))
                    reader.read_local(s.name, k, sp, f.param_start, f.param_start + f.length, out)
                    want = sp.shard(full[k][s.name]).reshape(-1)[f.param_start:f.param_start
                                                                 + f.length]
                    assert torch.equal(out, want), (source, target, t, d, s.name, k)
            assert reader.bytes_read == 4 * len(KINDS) * real_elements(tp, t, dp, d), (t, d)


def test_full_tensors_and_format_1(tmp_path, full):
    new, old = tmp_path / "new", tmp_path / "old"
    write_checkpoint(new, full, 3, 2)
    write_checkpoint(old, full, 3, 2, version=1)
    for root in (new, old):
        reader = CheckpointReader(root)
        for n in PARAMS:
            for k in KINDS:
                assert torch.equal(reader.full_tensor(n, k), full[k][n]), (root.name, n, k)
    # format 2 stores each element once: replicated tensors only on TP rank 0, no padding
    stored = sum(int(safe_open(str(p), "pt").get_slice(f"master/{n}").get_shape()[0])
                 for p in (new / "iter_0000001").glob("rank_*.safetensors")
                 for n in json.loads(safe_open(str(p), "pt").metadata()["layout"]))
    assert stored == sum(full["master"][n].numel() for n in PARAMS)


def test_consolidation_streams_one_tensor_at_a_time(tmp_path, full, monkeypatch):
    write_checkpoint(tmp_path / "ck", full, 2, 2)
    import hybrid.checkpoint.fragments as fragments

    monkeypatch.setattr(fragments, "READ_CHUNK", 7)  # many small reads: the chunking path
    alive, peak = [0], [0]
    real = CheckpointReader.full_tensor

    def tracked(self, name, kind="master"):
        t = real(self, name, kind)
        alive[0] += 1
        peak[0] = max(peak[0], alive[0])
        import weakref

        weakref.finalize(t, lambda: alive.__setitem__(0, alive[0] - 1))
        return t

    monkeypatch.setattr(CheckpointReader, "full_tensor", tracked)
    out = tmp_path / "model.safetensors"
    assert consolidate_main(["--load", str(tmp_path / "ck"), "--output", str(out)]) == 0
    from safetensors.torch import load_file

    state = load_file(str(out))
    assert set(state) == set(PARAMS) and all(torch.equal(state[n], full["master"][n])
                                             for n in PARAMS)
    assert peak[0] == 1  # each full tensor was freed before the next was assembled


def test_damaged_checkpoint_is_refused(tmp_path, full):
    from hybrid.checkpoint.directory import IncompleteCheckpointError

    write_checkpoint(tmp_path, full, 2, 2)
    p = tmp_path / "iter_0000001" / shard_name(1)  # tp rank 1, dp rank 0
    f = safe_open(str(p), "pt")
    lay = json.loads(f.metadata()["layout"])
    name = "layers.0.qkv.weight"
    assert lay[name]["tp_rank"] == 1
    tensors = {k: f.get_tensor(k) for k in f.keys() if not k.endswith(name)}
    lay.pop(name)
    tmp = p.with_name("damaged")
    write_safetensors(tmp, [Entry(k, v.dtype, tuple(v.shape), lambda v=v: v)
                            for k, v in tensors.items()],
                      {"layout": json.dumps(lay)})
    tmp.replace(p)
    with pytest.raises(IncompleteCheckpointError,
                       match=r"fragments of layers.0.qkv.weight \(tp rank 1\) do not tile"):
        CheckpointReader(tmp_path)
