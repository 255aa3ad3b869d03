"""``--tensorboard-dir``: the metrics records as TensorBoard scalars, as Megatron-LM writes them.

:class:`TensorBoardMetrics` wraps the run's :class:`hybrid.metrics.MetricsWriter`: every train and
evaluation record goes to the writer as before, and on global rank 0 its numbers also go to
``torch.utils.tensorboard.SummaryWriter`` at the record's iteration, under Megatron-LM's tag
names where it has one (``learning-rate``, ``batch-size``, ``lm loss``, ``loss-scale``,
``grad-norm``, ``lm loss validation``) and the record's own key otherwise.
"""

from __future__ import annotations

import math

TAGS = {"lr": "learning-rate", "global_batch_size": "batch-size", "lm_loss": "lm loss",
        "loss_scale": "loss-scale", "grad_norm": "grad-norm"}
"""Record key -> Megatron-LM's TensorBoard tag."""

SPLIT_TAGS = {"valid": "validation", "test": "test"}


def tensorboard_missing() -> str | None:
    """Why ``--tensorboard-dir`` cannot work here (the package is missing), or None."""
    import importlib.util

    if importlib.util.find_spec("tensorboard") is None:
        return ("--tensorboard-dir needs the tensorboard package (pip install tensorboard, or "
                "the project's tensorboard extra)")
    return None


class TensorBoardMetrics:
    """The metrics writer ``inner`` plus TensorBoard scalars in ``log_dir`` (``rank`` 0 only);
    every other attribute is ``inner``'s."""

    def __init__(self, inner, log_dir: str, rank: int):
        self.inner = inner
        self.tb = None
        if rank == 0:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=log_dir)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _scalars(self, record: dict, tag) -> None:
        if self.tb is None:
            return
        for key, value in record.items():
            if key in ("iteration", "split") or isinstance(value, bool):
                continue
            if isinstance(value, int | float) and math.isfinite(value):
                self.tb.add_scalar(tag(key), value, record["iteration"])

    def train(self, record: dict, total_iters: int) -> None:
        self.inner.train(record, total_iters)
        self._scalars(record, lambda k: TAGS.get(k, k))

    def eval(self, record: dict) -> None:
        self.inner.eval(record)
        split = SPLIT_TAGS.get(record.get("split"), record.get("split"))
        self._scalars(record, lambda k: f"{TAGS.get(k, k)} {split}")

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        self.inner.close()
