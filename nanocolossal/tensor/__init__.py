"""Tensor parallelism: one layer's weights split over T ranks, collectives inside the layer.

    comm.py       the conjugate collectives (copy_to/reduce_from = Megatron's f/g, gather, split)
    base.py       the initialisation contract (build full, keep your slice) and replica marks
    layers_1d.py  Megatron: column- and row-parallel Linear, Embedding, PatchEmbedding, Classifier
    summa.py      SUMMA: the q-step broadcast-multiply-accumulate on a q x q grid, and its backward
    layers_2d.py  Colossal-AI's 2d: Linear2D, LayerNorm2D, PatchEmbedding2D, Classifier2D, loss
    zigzag.py, ring_attention.py   sequence parallelism: who holds which tokens; attention
                  over a sequence split across ranks (K/V around a ring, online softmax)

Models use them through nanocolossal.nn, which picks the layer for gpc.tensor_mode.
"""
from . import base, comm, layers_1d, layers_2d, summa

__all__ = ["base", "comm", "layers_1d", "layers_2d", "summa"]
