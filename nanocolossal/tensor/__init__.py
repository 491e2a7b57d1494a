"""Tensor parallelism: one layer's weights split over T ranks, collectives inside the layer.

    comm.py       the conjugate collectives (copy_to/reduce_from = Megatron's f/g, gather, split)
    base.py       the initialisation contract (build full, keep your slice) and replica marks
    layers_1d.py  Megatron: column- and row-parallel Linear, Embedding, PatchEmbedding, Classifier
    summa.py      SUMMA: the q-step broadcast-multiply-accumulate on a q x q grid, and its backward
    layers_2d.py  Colossal-AI's 2d: Linear2D, LayerNorm2D, PatchEmbedding2D, Classifier2D, loss;
                  2.5d (Tesseract): the same on depth stacked grids
    cube.py       3d: the product on a q x q x q cube (all-gathers, reduce-scatter), its layouts
    layers_3d.py  Linear3D and the 3d vocabulary-parallel layers (the rest are 2d's, on the cube)
    zigzag.py, ring_attention.py   sequence parallelism: who holds which tokens; attention
                  over a sequence split across ranks (K/V around a ring, online softmax)

Models use them through nanocolossal.nn, which picks the layer for gpc.tensor_mode.
"""
from . import base, comm, cube, layers_1d, layers_2d, layers_3d, summa

__all__ = ["base", "comm", "cube", "layers_1d", "layers_2d", "layers_3d", "summa"]
