"""``python -m hybrid.export_hf``: a Hugging Face GPT-2 directory from a training checkpoint
(see ``hybrid.hf.export``)."""

from hybrid.hf.export import main

if __name__ == "__main__":
    raise SystemExit(main())
