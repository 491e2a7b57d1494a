"""`colossalai.core`: the tutorials write `from colossalai.core import global_context as gpc`.

The one global context is nanocolossal.context.gpc; this module only gives it that import path.
"""
from .context import gpc as global_context

__all__ = ["global_context"]
