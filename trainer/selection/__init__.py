"""Model-selection batches: many trials of one base spec trained side by side on a node's devices
with HYDRA shard alternation (Sharded-LRTF), and ASHA early stopping.

This package's __init__ imports nothing, so `trainer.selection.space` (standard library only) can be
imported by a process that has no torch, such as the REST layer.
"""
