"""Data pipeline: corpus -> sentencepiece tokenizer -> Megatron .bin/.idx -> GPT samples -> loader.

Modules, in pipeline order:

* ``build_corpus``: the embedded default corpus (stdlib docstrings, no network).
* ``text_source``: open local files, saved datasets or hub datasets through ``datasets``.
* ``train_tokenizer`` / ``tokenizer``: train a sentencepiece model; the ``Tokenizer`` wrapper.
* ``preprocess`` / ``merge`` / ``indexed_dataset``: tokenize to Megatron-LM's indexed format.
* ``split`` / ``gpt_dataset`` / ``blended_dataset`` / ``index_cache`` / ``rank0_first``:
  cached, shuffled ``seq_length + 1``-token samples per split, blended by weight.
* ``loader``: per-data-parallel-rank micro-batches with exact resume.
* ``batches``: each micro-batch checked against the vocabulary, packed documents' layout.

``scripts/preprocess_data.sh`` runs the first steps end to end.
"""
