"""``python -m hybrid.plan``: the memory planner's command line (see ``hybrid.planner.cli``)."""

from hybrid.planner.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
