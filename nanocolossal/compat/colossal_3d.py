"""Colossal-AI's 3d layer classes (Linear3D, ...), by name and constructor arguments.

Over tensor/layers_3d.py, with colossal_2d.py's argument handling (the same arguments mean the
same things). Linear3D is column or row by the alternation nc.nn.Linear follows (Colossal-AI's
Linear3D swaps its input and output groups after each layer the same way): pairs start and end
in layout A.
"""
from __future__ import annotations

from ..nn.layers import alternate
from ..tensor import layers_3d
from . import colossal_2d as c2d
from .colossal_args import in_mode


class Linear3D(c2d.ColossalLinear, layers_3d.Linear3D):
    """The cube product: layout A -> B (column) or B -> A (row), alternating."""
    MODE = "3d"

    def layer_args(self) -> tuple:
        return (alternate(),)


LayerNorm3D = in_mode(c2d.LayerNorm2D, "LayerNorm3D", "3d",
                      "LayerNorm on layout A: statistics summed over z.")
Embedding3D = in_mode(c2d.Embedding2D, "Embedding3D", "3d", "Token embedding into layout A.")
PatchEmbedding3D = in_mode(c2d.PatchEmbedding2D, "PatchEmbedding3D", "3d",
                           "ViT's patch embedding into layout A.")
Classifier3D = in_mode(c2d.Classifier2D, "Classifier3D", "3d",
                       "Whole logits per sample of batch share (x, y); `weight=` ties Embedding3D.")
CrossEntropyLoss3D = in_mode(c2d.CrossEntropyLoss2D, "CrossEntropyLoss3D", "3d",
                             "F.cross_entropy of the whole batch from layout A's logits.")


class VocabParallelEmbedding3D(c2d.ColossalEmbedding, layers_3d.VocabParallelEmbedding3D):
    """Embedding with the table cut as a column Linear's weight (vocabulary over y)."""
    MODE = "3d"


class VocabParallelClassifier3D(c2d.ColossalClassifier,
                                layers_3d.VocabParallelClassifier3D):
    """Logits in layout B, vocabulary over y. `weight=`: a VocabParallelEmbedding3D's table."""
    MODE = "3d"


class VocabParallelCrossEntropyLoss3D(c2d.ColossalLoss,
                                      layers_3d.VocabParallelCrossEntropyLoss3D):
    """Cross-entropy of layout B's vocabulary-split logits: reduction True or False, ..."""
    MODE = "3d"
