"""Colossal-AI's 2.5d layer classes (Linear2p5D, ...), by name and constructor arguments.

2.5d's layers are 2d's on each of the stacked grids (tensor/layers_2d.py), so each class is its
2d namesake (colossal_2d.py: the same arguments, the same meaning) under mode '2.5d'. Outputs
hold this grid row's samples of this grid's share of the batch (depth x q shares); weight tiles
are the same in every grid, their gradients summed over the grids.
"""
from __future__ import annotations

from . import colossal_2d as c2d
from .colossal_args import in_mode

Linear2p5D = in_mode(c2d.Linear2D, "Linear2p5D", "2.5d", "SUMMA Linear in each grid.")
LayerNorm2p5D = in_mode(c2d.LayerNorm2D, "LayerNorm2p5D", "2.5d",
                        "LayerNorm over a hidden dimension split along the grid row.")
Embedding2p5D = in_mode(c2d.Embedding2D, "Embedding2p5D", "2.5d",
                        "Token embedding: this grid row's sequences, this column's dimensions.")
VocabParallelEmbedding2p5D = in_mode(c2d.VocabParallelEmbedding2D, "VocabParallelEmbedding2p5D",
                                     "2.5d", "The table in q x q tiles, alike in every grid.")
PatchEmbedding2p5D = in_mode(c2d.PatchEmbedding2D, "PatchEmbedding2p5D", "2.5d",
                             "ViT's patch embedding: this row's images, this column's channels.")
Classifier2p5D = in_mode(c2d.Classifier2D, "Classifier2p5D", "2.5d",
                         "Whole logits per sample of this grid row; `weight=` ties Embedding2p5D.")
VocabParallelClassifier2p5D = in_mode(
    c2d.VocabParallelClassifier2D, "VocabParallelClassifier2p5D", "2.5d",
    "Logits in [batch share, vocabulary slice]; `weight=` ties VocabParallelEmbedding2p5D.")
CrossEntropyLoss2p5D = in_mode(c2d.CrossEntropyLoss2D, "CrossEntropyLoss2p5D", "2.5d",
                               "F.cross_entropy of the whole batch from this row's logits.")
VocabParallelCrossEntropyLoss2p5D = in_mode(
    c2d.VocabParallelCrossEntropyLoss2D, "VocabParallelCrossEntropyLoss2p5D", "2.5d",
    "Cross-entropy of vocabulary-split logits, summed over every grid's rows.")
