"""Which half type a CPU computes in: decided from its instruction set, never from a timing.

On a GPU, `fp16=dict(mode=...)` means float16 (or bfloat16): both have fast kernels. A CPU has
no fast float16 kernels at all (a ResNet-34 step measured 75x slower than in bfloat16), and
only CPUs with bfloat16 instructions (x86's AVX512-BF16 or AMX) have fast bfloat16 ones (without
them a bf16 ResNet-34 step measured 40x slower than fp32). So on a CPU `cpu_half_dtype()` is
torch.bfloat16 if this CPU has them, else None: compute in float32.

Not a timing: numerics must not depend on how busy the machine was (a run and its resumed half
would compute in different types). Rank 0 decides and broadcasts, so a job on mixed machines
computes alike; initialize logs the choice, save_checkpoint stores it (`stored_choice`) and
load_checkpoint warns when the resuming run computes in another type. `fp16=dict(...,
dtype=...)` overrides it (this module is then never asked); gpc.destroy() forgets the answer.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .context import gpc, on_destroy

# The answer, under the key "dtype" once decided (None is a valid answer: float32).
_cache: dict[str, Optional[torch.dtype]] = {}


def has_bf16_instructions() -> bool:
    """Does this CPU compute bfloat16 natively (not emulated)? torch's own CPU feature checks."""
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in checks)


def cpu_half_dtype() -> Optional[torch.dtype]:
    """rank 0's answer, the same on every rank; decided on the first call, then cached."""
    if "dtype" not in _cache:
        answer = [torch.bfloat16 if has_bf16_instructions() else None]
        if gpc.is_initialized and gpc.world_size > 1:
            dist.broadcast_object_list(answer, src=0)
        _cache["dtype"] = answer[0]
    return _cache["dtype"]


def stored_choice() -> Optional[str]:
    """What a checkpoint records: 'bfloat16' or 'float32' if this job asked, else None."""
    if "dtype" not in _cache:
        return None
    return str(_cache["dtype"] or torch.float32).removeprefix("torch.")


def reset_cpu_half_dtype() -> None:
    """Forget the answer: the next cpu_half_dtype() decides again."""
    _cache.clear()


on_destroy(reset_cpu_half_dtype)
