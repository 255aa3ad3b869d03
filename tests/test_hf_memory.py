"""Peak memory of the Hugging Face import and export, as the checkpoint path's bounds
(tests/test_checkpoint_memory.py): ``--init-from-hf`` into tp1 x dp2 ZeRO-3 and ``export_hf``
of the saved checkpoint each stay within one unit (fp32) plus one tensor's worth, counted
twice for the q/k/v tensors assembled into one of ours (or split from it), plus 16 MiB of
allocator slack. The model is sized so that holding it whole would exceed the bound.

Import: the whole resident set (``VmHWM``; the HF files are opened per read). Export: the
anonymous resident set, sampled (the checkpoint reader keeps its shards memory-mapped, and the
pages it touched stay in the resident set as page cache the kernel may drop)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from hybrid.parallel.spawn import spawn_world  # noqa: E402
from tests.hf_worlds import import_export_peaks  # noqa: E402

MIB = 2**20
HF = dict(vocab_size=4096, hidden_size=256, intermediate_size=1024, num_hidden_layers=16,
          num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256,
          tie_word_embeddings=False)
OURS = dict(num_layers=16, hidden_size=256, num_attention_heads=8, num_query_groups=2,
            ffn_hidden_size=1024, vocab_size=4096, max_position_embeddings=256,
            position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
            add_bias_linear=False, layernorm_epsilon=1e-6,
            untie_embeddings_and_output_weights=True)


@pytest.mark.timeout(900)
def test_import_and_export_peaks_are_one_unit_plus_one_tensor(tmp_path):
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**HF)).save_pretrained(str(tmp_path / "llama"),
                                                        max_shard_size="10MB")
    res = spawn_world(2, import_export_peaks, str(tmp_path / "llama"), OURS,
                      str(tmp_path / "ckpt"), timeout_s=600)
    for r in res:
        bound = r["unit"] + 2 * r["largest"] + 16 * MIB
        print(f"import peak {r['import_peak'] / MIB:.1f} MiB, export peak "
              f"{r.get('export_peak', 0) / MIB:.1f} MiB; unit {r['unit'] / MIB:.1f} MiB, largest "
              f"tensor {r['largest'] / MIB:.1f} MiB, model {r['model'] / MIB:.1f} MiB, bound "
              f"{bound / MIB:.1f} MiB")
        assert r["import_peak"] <= bound, r
        assert r.get("export_peak", 0) <= bound, r
        assert r["model"] > bound  # holding the model whole would fail
    assert res[0]["sampler_check"] >= 0.9 * res[0]["model"], res[0]
