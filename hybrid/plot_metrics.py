"""Turn a metrics JSONL file (``--metrics-file``) into PNG plots.

``python -m hybrid.plot_metrics METRICS.jsonl [more.jsonl ...] --output-dir DIR`` writes
``loss.png`` (training and validation loss against iteration), ``lr.png`` and
``throughput.png`` (tokens/s and TFLOP/s per device). Several files are overlaid, labelled by
file name. Needs matplotlib (``pip install hybrid-zero[plot]``).
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path


def read_metrics(path: str | Path) -> tuple[list[dict], list[dict]]:
    """``(train_records, eval_records)`` of one JSONL file, each sorted by iteration, keeping
    the latest record per iteration (and eval split). A ``start`` record at iteration k (written
    by every launch) drops the earlier records after k: a job that crashed at iteration 6 and
    resumed from a checkpoint at 4 appends a start at 4 and 5..8 after 1..6, and reads as 1..8
    with the resumed run's 5 and 6; a fresh run (start at 0) reusing the file hides the older
    run's records, which stay in the file.

    A line that is not a JSON record (a record cut short by a crash) is skipped with a warning
    naming its line number.

    Raises:
        FileNotFoundError: no such file.
        ValueError: no line of the file is a JSON record (the first bad line is named), or the
            file is empty.
    """
    latest: dict[tuple, dict] = {}
    bad: list[str] = []
    n_records = 0
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError as e:
                bad.append(f"{path}:{n}: not a JSON record ({e})")
                continue
            if not isinstance(r, dict):
                bad.append(f"{path}:{n}: not a JSON record (a {type(r).__name__})")
                continue
            n_records += 1
            # a launch from iteration k: what came after k is superseded
            if r.get("kind") == "start":
                latest = {key: v for key, v in latest.items()
                          if v.get("iteration", 0) <= r["iteration"]}
                continue
            kind = "eval" if r.get("kind") == "eval" else "train"
            # a later line replaces an earlier one
            latest[(kind, r.get("split"), r.get("iteration"))] = r
    if bad and not n_records:
        raise ValueError(bad[0])
    if not n_records:
        raise ValueError(f"{path}: no metrics records (the file is empty)")
    for message in bad:
        warnings.warn(f"{message}; skipped", stacklevel=2)
    records = sorted(latest.items(), key=lambda kv: kv[1].get("iteration", 0))
    train = [r for (kind, _, _), r in records if kind == "train"]
    evals = [r for (kind, _, _), r in records if kind == "eval"]
    return train, evals


def run_labels(paths: list[str]) -> list[str]:
    """One legend label per file: its name without suffix, or as many parent folders as make the
    labels distinct (``a/metrics``, ``b/metrics``), with the suffix when only it differs; a file
    given twice gets ``#2``."""
    for names in ([Path(p).with_suffix("").parts for p in paths], [Path(p).parts for p in paths]):
        for k in range(1, max(map(len, names), default=1) + 1):
            labels = ["/".join(parts[-k:]) for parts in names]
            if len(set(labels)) == len(labels):
                return labels
    seen: dict[str, int] = {}
    out = []
    for label in labels:
        seen[label] = seen.get(label, 0) + 1
        out.append(label if seen[label] == 1 else f"{label} #{seen[label]}")
    return out


def plot(paths: list[str], output_dir: str) -> list[Path]:
    """Write the PNGs for ``paths`` into ``output_dir``; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    runs = dict(zip(run_labels(paths), map(read_metrics, paths), strict=True))
    written = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, (train, evals) in runs.items():
        ax.plot([r["iteration"] for r in train], [r["lm_loss"] for r in train],
                label=f"{name} train")
        for split, marker in (("valid", "o"), ("test", "s")):
            pts = [r for r in evals if r.get("split") == split]
            if pts:
                ax.plot([r["iteration"] for r in pts], [r["lm_loss"] for r in pts], marker=marker,
                        linestyle="--" if split == "valid" else "none", label=f"{name} {split}")
    ax.set(xlabel="iteration", ylabel="lm loss", title="language-model loss")
    ax.grid(alpha=0.3)
    ax.legend()
    written.append(_save(fig, out / "loss.png"))
    for fname, keys, title in (("lr.png", ("lr",), "learning rate"),
                               ("throughput.png", ("tokens_per_sec", "tflops_per_device"),
                                "throughput")):
        fig, axes = plt.subplots(1, len(keys), figsize=(6 * len(keys), 4), squeeze=False)
        for ax, key in zip(axes[0], keys, strict=True):
            for name, (train, _) in runs.items():
                ax.plot([r["iteration"] for r in train], [r[key] for r in train], label=name)
            ax.set(xlabel="iteration", ylabel=key, title=f"{title}: {key}")
            ax.grid(alpha=0.3)
            ax.legend()
        written.append(_save(fig, out / fname))
    return written


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="hybrid-plot-metrics",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("metrics", nargs="+", help="metrics JSONL file(s)")
    parser.add_argument("--output-dir", default="plots", help="where the PNGs go")
    args = parser.parse_args(argv)
    try:
        for path in plot(args.metrics, args.output_dir):
            print(path)
    except (FileNotFoundError, ValueError) as e:
        print(f"hybrid-plot-metrics: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
