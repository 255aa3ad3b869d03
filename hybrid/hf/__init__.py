"""Hugging Face interoperability: GPT-2 weights in both directions, the tokenizer, and sampling.

``convert`` (names, layouts and settings; safetensors only) and ``weights`` (an HF directory
as a name -> tensor source) need only torch and safetensors, so ``hybrid.pretrain
--init-from-hf`` works without ``transformers``. ``tokenizer``, ``export`` and ``generate``
use ``transformers`` / ``tokenizers`` (the optional ``hf`` extra); nothing outside this
package imports them.
"""
