"""``--init-from-hf DIR`` alone: the model's shape from ``DIR/config.json``, as Megatron-Bridge and
transformers read it. Without ``--preset`` and the shape flags (``--num-layers``,
``--hidden-size``, ``--num-attention-heads``), the flag line that reproduces config.json
(:func:`hybrid.hf.llama_flags.flag_line`, :func:`hybrid.hf.convert.flag_line`) goes before the
given flags; the job prints it, so the run is reproducible without the directory. Flags given
explicitly come later and win; one that disagrees with config.json is then refused by the
weight check with its usual message."""

from __future__ import annotations


def hf_model_flags(hf_dir: str) -> list[str]:
    """The model flags of ``hf_dir/config.json`` (GPT-2, Llama, Qwen2, Qwen3).

    Raises:
        FileNotFoundError / ValueError: no readable config.json, or a model we cannot hold.
    """
    from hybrid.hf import convert
    from hybrid.hf.llama_config import hf_settings
    from hybrid.hf.llama_flags import flag_line
    from hybrid.hf.weights import read_hf_config

    hf = read_hf_config(hf_dir)
    where = f"--init-from-hf {hf_dir}"
    if hf.get("model_type") == "gpt2":
        return convert.flag_line(hf).split()
    return flag_line(hf_settings(hf, where + ": config.json"), hf).split()

