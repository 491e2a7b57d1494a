"""`colossalai.utils`: the tutorials' `get_dataloader` (data.py), `MultiTimer` (timer.py) and
`checkpoint` (activation_checkpoint.py), by that path."""
from .activation_checkpoint import checkpoint
from .data import get_dataloader
from .timer import MultiTimer, Timer

__all__ = ["MultiTimer", "Timer", "checkpoint", "get_dataloader"]
