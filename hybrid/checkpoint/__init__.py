"""Training checkpoints: the format door (``format``, ``registry``; ``--ckpt-format``) and the
default format's per-rank safetensors shards of the ZeRO partitions, the atomic
directory/publication protocol every format shares, weights-only loading, and consolidation into
one state dict for the plain GPT. When the job saves, resumes and stops is the job's
(``hybrid.job``)."""
