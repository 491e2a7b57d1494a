"""`nanocolossal plan`: will it fit? Every layout's memory per rank, traffic per step and bubble,
before launch, from the formulas the book teaches (cli.py; the formulas in formulas.py,
traffic.py, activations.py, a rank's plan in ranks.py; the model in model.py; layouts and checks
in layouts.py)."""
from .cli import main
from .formulas import Layout
from .layouts import load, search
from .model import GPT
from .ranks import plan_layout, plan_rank

__all__ = ["GPT", "Layout", "load", "main", "plan_layout", "plan_rank", "search"]
