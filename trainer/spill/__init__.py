"""HYDRA model spilling and the AxoNN offloaded optimizer.

The engine's API note is at the top of `trainer/spill/engine.py`; the pure-Python sizing rule the
REST layer checks at submit is `jobrules/sizing.py`.
"""
