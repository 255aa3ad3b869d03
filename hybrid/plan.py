"""``python -m hybrid.plan`` / ``hybrid-plan``: the memory planner's command line
(:mod:`hybrid.planner.cli`), with ``--verify``'s dry run of the best layout
(:func:`hybrid.dryrun.verify.verify_plan`). The entry point joins the two: the dry run builds on
the planner, so the planner never starts it (it stands on the floor below)."""

from hybrid.dryrun.verify import verify_plan
from hybrid.planner.cli import main as plan_main


def main(argv: list[str] | None = None) -> int:
    """The planner on ``argv`` (default: the command line's), ``--verify`` included; returns the
    exit status (2 for bad input)."""
    return plan_main(argv, verify=verify_plan)


if __name__ == "__main__":
    raise SystemExit(main())
