"""Hugging Face interoperability: GPT-2, Llama, Qwen2 and Qwen3 weights in both directions,
the tokenizer, and sampling.

``convert`` (GPT-2), ``llama_config`` / ``llama_weights`` (Llama, Qwen2, Qwen3: settings,
names, layouts), ``weights`` (an HF directory as a name -> tensor source) and ``sharded`` need
only torch and safetensors, so ``hybrid.pretrain --init-from-hf`` works without
``transformers``. ``tokenizer``, ``export_tokenizer``, ``export`` and ``generate`` use
``transformers`` (the optional ``hf`` extra); nothing outside this package imports it
(``data.hf_tokenizer`` and ``data.gpt2_bpe`` use the ``tokenizers`` library alone).
"""
