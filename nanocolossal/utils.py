"""`colossalai.utils`: the tutorials' `get_dataloader` (data.py) and `MultiTimer` (timer.py), by
that path."""
from .data import get_dataloader
from .timer import MultiTimer, Timer

__all__ = ["MultiTimer", "Timer", "get_dataloader"]
