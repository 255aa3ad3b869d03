"""When sequence parallelism takes effect (pure, no torch: the CLI's header reads it too)."""

from __future__ import annotations


def sequence_parallel_active(requested: bool, tp: int) -> bool:
    """Whether ``--sequence-parallel`` changes anything at tensor-model-parallel size ``tp``.

    Sequence parallelism (Korthikanti et al. 2022, arXiv 2205.05198 §4.2.2) splits the
    sequence over the TP group; at ``tp = 1`` there is no group to split over, so the flag has
    no effect there, as in Megatron-LM. The TP plan, the planner, the dry run and the run's
    header all decide it here.
    """
    return bool(requested) and tp > 1


TP_COMM_OVERLAP_NEEDS_SP = ("pipelines the all-gathers and reduce-scatters of "
                            "sequence parallelism: it needs --sequence-parallel with "
                            "--tensor-model-parallel-size > 1 (as Megatron-LM)")
"""The refusal of ``--tp-comm-overlap`` without sequence parallelism in effect."""
