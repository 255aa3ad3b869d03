"""Training checkpoints: per-rank safetensors shards of the ZeRO partitions, the atomic
directory/publication protocol, the save policy (interval, SIGTERM, time limit), and
consolidation into one state dict for the plain GPT."""
