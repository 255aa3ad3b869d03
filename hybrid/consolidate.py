"""``python -m hybrid.consolidate``: one fp32 state dict from a distributed checkpoint (see
``hybrid.checkpoint.consolidate``)."""

from hybrid.checkpoint.consolidate import main

if __name__ == "__main__":
    raise SystemExit(main())
