"""Tensor parallelism: one layer's weights split over T ranks, collectives inside the layer.

Reading order: comm.py (the conjugate collectives), base.py (build whole, keep your slice),
layers_1d.py (Megatron), summa.py and layers_2d.py (2d, 2.5d), cube.py and layers_3d.py (3d),
vocab_parallel*.py; zigzag.py, ring_attention.py, ulysses.py (sequence parallelism). Models use
them through nanocolossal.nn, which picks the layer for gpc.tensor_mode.
"""
