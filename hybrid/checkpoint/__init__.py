"""Training checkpoints: per-rank safetensors shards of the ZeRO partitions, the atomic
directory/publication protocol, weights-only loading, and consolidation into one state dict for
the plain GPT. When the job saves, resumes and stops is the job's (``hybrid.job``)."""
