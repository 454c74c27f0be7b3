"""Tensor parallelism: 1-D (Megatron), 2-D (SUMMA) and 2.5-D (Tesseract), with a communication ledger.

Files: grid.py (shape checks, then the process grids and their groups from a DeviceMesh), comm.py (the one module that
issues collectives, and the ledger that counts them), layers_1d.py, layers_25d.py (2-D is its d=1
case), block.py (dense GPT layers -> sharded ones), traffic.py (the run's traffic, gathered for the
result).
"""
