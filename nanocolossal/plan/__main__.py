"""`python -m nanocolossal.plan ...`: the same as `nanocolossal plan ...` (cli.py)."""
import sys

from .cli import main

sys.exit(main())
