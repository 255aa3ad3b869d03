"""The memory/communication/time planner (arXiv 1910.02054 §5, 2205.05198 Table 2, 2104.04473
§3): model-state and activation bytes, data- and tensor-parallel traffic, the search over
tp x ZeRO stage x checkpointing, its CLI, and the planner-vs-engine check."""
