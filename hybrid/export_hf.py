"""``python -m hybrid.export_hf``: a Hugging Face model directory (GPT-2, Llama, Qwen2, Qwen3)
from a training checkpoint (see ``hybrid.hf.export``)."""

from hybrid.hf.export import main

if __name__ == "__main__":
    raise SystemExit(main())
