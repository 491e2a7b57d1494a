"""`colossalai.nn.metric`: the tutorials' `Accuracy`, i.e. nanocolossal.metrics.Accuracy."""
from ..metrics import Accuracy

__all__ = ["Accuracy"]
