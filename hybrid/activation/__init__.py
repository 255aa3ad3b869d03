"""Activation checkpointing and ZeRO-R's activation memory (arXiv 1910.02054 §6.1): full
recompute, partitioned checkpoints (Pa), Pa+cpu, the contiguous checkpoint arena, and the
saved-for-backward bytes meter."""
