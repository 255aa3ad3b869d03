"""A local Hugging Face GPT-2 directory as a source of our full tensors (``--init-from-hf``).

Reads ``config.json`` and ``model.safetensors`` (or the shards a ``model.safetensors.index.json``
lists) with safetensors only: no ``transformers``, and nothing unpickled (``pytorch_model.bin``
is refused). Tensors are read one at a time when asked for.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open

from hybrid.hf.convert import check_hf_config, from_hf, our_name, parameter_names
from models.gpt import GPTConfig


def read_hf_config(hf_dir: str | os.PathLike) -> dict:
    """``HF_DIR/config.json`` as a dict.

    Raises:
        FileNotFoundError: no such directory or no ``config.json`` in it.
    """
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{hf_dir} is not a Hugging Face model directory (no config.json)")
    return json.loads(path.read_text())


def _weight_files(hf_dir: Path) -> list[Path]:
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [hf_dir / f for f in files]
    if (hf_dir / "model.safetensors").is_file():
        return [hf_dir / "model.safetensors"]
    pickled = [p.name for p in hf_dir.glob("*.bin")]
    raise FileNotFoundError(
        f"{hf_dir} has no model.safetensors (or index)"
        + (f"; {pickled} are pickle files, which are not loaded: re-save with "
           "save_pretrained(..., safe_serialization=True)" if pickled else ""))


class HFWeights:
    """Our full tensors (``GPT.named_parameters()`` names, fp32) read from a GPT-2 directory.

    Call it with a name: ``source("layers.0.attn.qkv.weight") -> [3h, h]``.

    Args:
        hf_dir: a directory written by ``save_pretrained`` (or ``hybrid.export_hf``).
        config: the model the weights go into; ``config.json`` must describe it.

    Raises:
        FileNotFoundError: missing config or weights.
        hybrid.hf.convert.UnsupportedModelError / ValueError: see
            :func:`hybrid.hf.convert.check_hf_config`; a tensor our model has no place for;
            a parameter missing from the files; a tensor whose shape differs from ours (the
            first one, named, with both shapes).
    """

    def __init__(self, hf_dir: str | os.PathLike, config: GPTConfig):
        self.dir, self.config = Path(hf_dir), config
        check_hf_config(read_hf_config(hf_dir), config, where=str(self.dir / "config.json"))
        self._where: dict[str, tuple[object, str]] = {}
        self._handles = []
        for path in _weight_files(self.dir):
            f = safe_open(str(path), framework="pt")
            self._handles.append(f)
            for key in f.keys():
                name = our_name(key)
                if name == "lm_head.weight" and config.tied:
                    continue  # a tied head saved anyway: it is wte.weight
                if name is not None:
                    self._where[name] = (f, key)
        expected = parameter_names(config)
        missing = [n for n in expected if n not in self._where]
        unexpected = sorted(set(self._where) - set(expected))
        if missing:
            raise ValueError(f"{self.dir}: no tensor for our parameter {missing[0]!r} "
                             f"({len(missing)} missing in all)")
        if unexpected:
            raise ValueError(f"{self.dir}: tensors our model has no place for: {unexpected}")
        self._check_shapes()

    def _check_shapes(self) -> None:
        """Compare every stored shape with ours before any tensor is read; name the first
        mismatch."""
        from models.gpt import GPT

        with torch.device("meta"):
            ours = dict(GPT(self.config).named_parameters())
        for name in parameter_names(self.config):
            f, key = self._where[name]
            stored = tuple(f.get_slice(key).get_shape())
            try:
                want = tuple(from_hf(name, torch.empty(stored, device="meta"), self.config).shape)
            except RuntimeError:  # not even reshapeable into our layout
                want = stored
            if want != tuple(ours[name].shape):
                raise ValueError(f"{self.dir}: {key} has shape {list(stored)}, which gives {name} "
                                 f"shape {list(want)}; our model has {list(ours[name].shape)}")

    def names(self) -> list[str]:
        """Our parameter names this source provides (every one of the model's)."""
        return parameter_names(self.config)

    def __call__(self, name: str) -> torch.Tensor:
        """Our full fp32 tensor ``name``, contiguous."""
        if name not in self._where:
            raise KeyError(f"{self.dir} has no tensor for our parameter {name!r}")
        f, key = self._where[name]
        return from_hf(name, f.get_tensor(key), self.config).float().contiguous()
