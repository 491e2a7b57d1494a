"""nanocolossal.nn: Colossal-AI's `colossalai.nn` -- layers that follow the tensor-parallel mode.

    import nanocolossal.nn as col_nn
    col_nn.Linear(384, 1536)      # torch.nn.Linear alone, Linear1D / Linear2D under parallel.tensor

See layers.py for the table of what each name becomes in each mode. `col_nn.lr_scheduler` and
`col_nn.metric` are Colossal-AI's schedulers and metrics, by the tutorials' paths.

Colossal-AI's mode-specific classes, with its constructor arguments, are importable here too
(they live in compat/colossal_1d.py, colossal_2d.py, colossal_2p5d.py and colossal_3d.py):
`col_nn.Linear1D_Col(384, 1536, gather_output=True)`, ...
"""
from ..compat.colossal_1d import (
    Classifier1D,
    Dropout1D,
    Embedding1D,
    Linear1D_Col,
    Linear1D_Row,
    VocabParallelClassifier1D,
    VocabParallelCrossEntropyLoss1D,
    VocabParallelEmbedding1D,
)
from ..compat.colossal_2d import (
    Classifier2D,
    CrossEntropyLoss2D,
    Embedding2D,
    LayerNorm2D,
    Linear2D,
    PatchEmbedding2D,
    VocabParallelClassifier2D,
    VocabParallelCrossEntropyLoss2D,
    VocabParallelEmbedding2D,
)
from ..compat.colossal_2p5d import (
    Classifier2p5D,
    CrossEntropyLoss2p5D,
    Embedding2p5D,
    LayerNorm2p5D,
    Linear2p5D,
    PatchEmbedding2p5D,
    VocabParallelClassifier2p5D,
    VocabParallelCrossEntropyLoss2p5D,
    VocabParallelEmbedding2p5D,
)
from ..compat.colossal_3d import (
    Classifier3D,
    CrossEntropyLoss3D,
    Embedding3D,
    LayerNorm3D,
    Linear3D,
    PatchEmbedding3D,
    VocabParallelClassifier3D,
    VocabParallelCrossEntropyLoss3D,
    VocabParallelEmbedding3D,
)
from . import lr_scheduler, metric
from .layers import (
    VOCAB_PARALLEL_LIMIT,
    Classifier,
    CrossEntropyLoss,
    Dropout,
    Embedding,
    LayerNorm,
    Linear,
    PatchEmbedding,
    VocabParallelClassifier,
    VocabParallelCrossEntropyLoss,
    VocabParallelEmbedding,
    reset_1d_alternation,
)

__all__ = ["lr_scheduler", "metric", "VOCAB_PARALLEL_LIMIT", "Classifier", "CrossEntropyLoss",
           "Dropout", "Embedding", "LayerNorm", "Linear", "PatchEmbedding",
           "VocabParallelClassifier", "VocabParallelCrossEntropyLoss", "VocabParallelEmbedding",
           "reset_1d_alternation",
           # Colossal-AI's classes by mode
           "Classifier1D", "Dropout1D", "Embedding1D", "Linear1D_Col", "Linear1D_Row",
           "VocabParallelClassifier1D", "VocabParallelCrossEntropyLoss1D",
           "VocabParallelEmbedding1D", "Classifier2D", "CrossEntropyLoss2D", "Embedding2D",
           "LayerNorm2D", "Linear2D", "PatchEmbedding2D", "VocabParallelClassifier2D",
           "VocabParallelCrossEntropyLoss2D", "VocabParallelEmbedding2D",
           "Classifier2p5D", "CrossEntropyLoss2p5D", "Embedding2p5D", "LayerNorm2p5D",
           "Linear2p5D", "PatchEmbedding2p5D", "VocabParallelClassifier2p5D",
           "VocabParallelCrossEntropyLoss2p5D", "VocabParallelEmbedding2p5D",
           "Classifier3D", "CrossEntropyLoss3D", "Embedding3D", "LayerNorm3D", "Linear3D",
           "PatchEmbedding3D", "VocabParallelClassifier3D", "VocabParallelCrossEntropyLoss3D",
           "VocabParallelEmbedding3D"]
