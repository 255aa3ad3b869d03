"""The dry run: one rank of an N-rank job built and stepped on fake tensors, its memory report
and verdict (``hybrid.pretrain --dry-run-world-size N``), the fake CUDA device that lets it run
CUDA code paths on a CPU, ``hybrid.plan --verify`` (the planner's choice dry-run), and the
planner-vs-measurement check. It stands above ``hybrid.job`` and ``hybrid.planner``: it builds
a validated job and compares with the planner, and neither of them imports it; only the entry
points do (``hybrid.pretrain`` dispatches to it, ``hybrid.plan`` runs ``--verify``)."""
