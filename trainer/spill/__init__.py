"""HYDRA model spilling and the AxoNN offloaded optimizer.

Kept free of imports so the pure-Python sizing rules (`trainer.spill.sizing`) load without torch.
The engine's API note is at the top of `trainer/spill/engine.py`.
"""
