"""Mixed precision: the AMP modes a config can ask for.

A config selects mixed precision with ``fp16 = dict(mode=AMP_TYPE.TORCH)``, as in the
Colossal-AI tutorials. The three modes:

    TORCH  autocast around forward, fp32 weights, dynamic loss scaling   (~ apex O1)
    APEX   apex-like opt levels O0-O3 chosen with ``opt_level``
    NAIVE  fp16 model, fp32 master weights the optimizer updates         (~ apex O2)

A mode may also be written as its string value ("torch", "apex", "naive").
"""
from __future__ import annotations

from enum import Enum


class AMP_TYPE(Enum):
    TORCH = "torch"
    APEX = "apex"
    NAIVE = "naive"

    @classmethod
    def parse(cls, mode: "AMP_TYPE | str") -> "AMP_TYPE":
        """Accept an AMP_TYPE or its string value; anything else is a ValueError."""
        if isinstance(mode, cls):
            return mode
        if isinstance(mode, str):
            for member in cls:
                if mode.lower() in (member.value, member.name.lower()):
                    return member
        choices = ", ".join(f"AMP_TYPE.{m.name}" for m in cls)
        raise ValueError(f"unknown fp16 mode {mode!r}; use one of {choices}")
