"""Hooks that C++ holds must not keep the model alive.

A hook registered on a parameter (`register_post_accumulate_grad_hook`), on an output's autograd
node (`tensor.register_hook`) or saved in a custom autograd Function lives in C++. If it holds
its owner (DDP, ZeRO-3's ShardedModel), and the owner holds the model, whose parameters or kept
outputs hold the hook, the cycle passes through C++, where Python's garbage collector cannot see
it: a model dropped by the user would keep its process groups -- gloo's threads and sockets --
for the life of the process. The hook holds its owner weakly instead.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable


def weakly(method: Callable, *args: Any) -> Callable:
    """`partial(method, *args)` holding its object weakly; once that is gone, a no-op."""
    ref = weakref.WeakMethod(method)

    def call(*more: Any) -> Any:
        bound = ref()
        return None if bound is None else bound(*args, *more)
    return call
