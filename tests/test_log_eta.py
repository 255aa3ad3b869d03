"""Issue 28 item 7: the log line shows an ETA, the remaining iterations times the log window's
time per iteration, and the JSON record carries the same number (``eta_s``)."""

from hybrid.metrics import format_eta, format_train_line
from tests.test_training_loop import run


def test_format_eta():
    assert [format_eta(s) for s in (0, 59.4, 61, 3600, 3 * 3600 + 25 * 60 + 7)] == [
        "0:00:00", "0:00:59", "0:01:01", "1:00:00", "3:25:07"]
    assert format_eta(2 * 86400 + 5) == "2d 0:00:05"
    assert format_eta(-3) == "0:00:00"


def test_eta_is_remaining_iterations_times_the_windows_pace():
    # the fake clock advances 1 s per iteration; 6 iterations logged every 3 (with an
    # evaluation every 2, whose time is not iteration time)
    state, _ = run([5.0] * 6, log=3, eval=2)
    records = [r for r in state.history if "split" not in r]
    assert [(r["iteration"], r["eta_s"]) for r in records] == [(3, 3.0), (6, 0.0)]
    line = format_train_line(dict(records[0], memory_mb=1.0), 6)
    assert "| elapsed time per iteration (ms): 1000.0 | ETA: 0:00:03 | learning rate:" in line


def test_a_record_without_eta_keeps_megatrons_line():
    r = dict(iteration=1, consumed_samples=2, elapsed_ms=5.0, lr=1e-3, global_batch_size=2,
             lm_loss=1.0, loss_scale=1.0, grad_norm=1.0, skipped_iterations=0,
             nan_iterations=0, tokens_per_sec=1.0, tflops_per_device=0.0, memory_mb=1.0)
    assert "ETA" not in format_train_line(r, 10)
