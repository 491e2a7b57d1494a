"""`colossalai.nn.metric`: the tutorials' `Accuracy` is nanocolossal.metrics.Accuracy (exact over ranks)."""
from ..metrics import Accuracy

__all__ = ["Accuracy"]
