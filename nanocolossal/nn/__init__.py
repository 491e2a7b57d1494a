"""nanocolossal.nn: Colossal-AI's `colossalai.nn` -- layers that follow the tensor-parallel mode.

    import nanocolossal.nn as col_nn
    col_nn.Linear(384, 1536)      # torch.nn.Linear alone, Linear1D / Linear2D under parallel.tensor

See layers.py for the table of what each name becomes in each mode. `col_nn.lr_scheduler` and
`col_nn.metric` are Colossal-AI's schedulers and metrics, by the tutorials' paths.

Colossal-AI's mode-specific classes, with its constructor arguments, are importable here too
(they live in compat/colossal_1d.py, colossal_2d.py, colossal_2p5d.py and colossal_3d.py):
`col_nn.Linear1D_Col(384, 1536, gather_output=True)`, ...
"""
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
           "reset_1d_alternation"]


def __getattr__(name: str):
    """Colossal-AI's classes by mode (Linear1D_Col, Linear2D, ...), from compat/."""
    from ..compat import colossal_1d, colossal_2d, colossal_2p5d, colossal_3d
    for module in (colossal_1d, colossal_2d, colossal_2p5d, colossal_3d):
        if name in vars(module) and isinstance(vars(module)[name], type):
            return vars(module)[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
