"""Issue 33's acceptance figure as a test: bytes the ZeRO engine moves outside its collectives per
micro-batch (``scripts/bench_zero_bytes.py``'s measurement, dp 2, fp32 and bf16 gradients),
with gradient-accumulation fusion off (the path before the issue) and on. Targets: no staging
copy at stages 0/1; one pass over the gradient at stages 2/3 (its copy into the reduce-scatter
input, then the reduced 1/dp added into the partition)."""

import sys
from pathlib import Path

import pytest

from hybrid.parallel.spawn import spawn_world

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from bench_zero_bytes import measure  # noqa: E402

DP = 2


@pytest.fixture(scope="module")
def measured():
    return spawn_world(DP, measure, (0, 1, 2, 3), ("fp32", "bf16+bf16grad"), timeout_s=120)[0]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("prec, g", [("fp32", 4), ("bf16+bf16grad", 2)])
def test_bytes_per_element_per_micro_batch(measured, prec, g):
    """``g``: gradient bytes per element. Accumulating a micro-batch reads the new gradient and
    reads and writes the buffer (3g); averaging reads and writes what is averaged (2g)."""
    def mb(stage, fusion):
        return measured[(stage, prec, fusion)]["micro_batches"]

    def ops(stage, fusion):
        return measured[(stage, prec, fusion)]["ops"]

    for fusion in (False, True):  # stage 0: in-place all-reduce of the accumulated buffer
        assert mb(0, fusion) == pytest.approx([3 * g, 3 * g + 2 * g])
    # stage 1 before: accumulate, stage the whole buffer in (2g), average it (2g), copy 1/dp out
    assert mb(1, False) == pytest.approx([3 * g, 3 * g + 4 * g + 2 * g / DP])
    assert "_foreach_copy_" in ops(1, False)[1]
    # stage 1 with fusion: reduce-scattered in place, only the owned 1/dp averaged
    assert mb(1, True) == pytest.approx([3 * g, 3 * g + 2 * g / DP])
    for fusion in (False, True):
        assert all("_foreach_copy_" not in o for o in ops(0, fusion))
    assert all("_foreach_copy_" not in o for o in ops(1, True))  # no staging copy at 0/1
    for stage in (2, 3):
        # before: zero the input (g), copy in (2g), average it (2g), add the 1/dp (3g / dp)
        assert mb(stage, False) == pytest.approx([5 * g + 3 * g / DP] * 2)
        # with fusion: one pass (copy in, 2g) and the averaged 1/dp added (3g / dp)
        assert mb(stage, True) == pytest.approx([2 * g + 3 * g / DP] * 2)
        assert set(ops(stage, True)[1]) == {"_foreach_copy_", "add_"}
