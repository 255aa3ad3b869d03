"""``python -m hybrid.generate``: sample text from a trained model (see ``hybrid.hf.generate``)."""

from hybrid.hf.generate import main

if __name__ == "__main__":
    raise SystemExit(main())
