"""The job description: a Python file of plain assignments, as in Colossal-AI.

    # config.py
    from nanocolossal.amp import AMP_TYPE
    BATCH_SIZE = 128
    NUM_EPOCHS = 2
    parallel = dict(pipeline=2)
    fp16 = dict(mode=AMP_TYPE.TORCH)

`load_config` turns such a file (or a dict, or a Config) into a `Config`: a dict whose keys are
also attributes (`cfg.parallel.pipeline`), with nested dicts converted too. Every global of the
file but modules, classes and dunders becomes a key, so `from nanocolossal.amp import AMP_TYPE`
in the file is fine (AMP_TYPE lives here, as the config names the modes; amp re-exports it).

A config is checked when it is loaded, not when a feature first reads it: a value we cannot honour
(an unknown tensor mode, a size that does not divide) or of the wrong type is an error that says
what to change, never silently ignored. A key the script reads but the file lacks says which file
and what to add (`MissingKeyError`):

    configs/x.py has no NUM_EPOCHS: add e.g. NUM_EPOCHS = 10

Both are user errors, not bugs: a script ends with the message alone, one line per rank, no
traceback (the hook that does this is in launch_checks.py).
"""
from __future__ import annotations

import inspect
import os
import runpy
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Union


class ConfigError(ValueError):
    """A config file or value that nanocolossal cannot use (a user error: the module docstring)."""


class MissingKeyError(ConfigError, AttributeError):
    """`cfg.NAME` for a key the config lacks. Also an AttributeError, so that hasattr(cfg, NAME)
    and getattr(cfg, NAME, default) keep working."""


# what "add e.g. KEY = value" suggests for the keys the scripts read
_EXAMPLES = {"BATCH_SIZE": "128", "NUM_EPOCHS": "10", "NUM_MICRO_BATCHES": "4", "NUM_CHUNKS": "2",
             "SEQ_LEN": "128", "TENSOR_SHAPE": "[4, 64]"}


class Config(dict):
    """A dict with attribute access; nested dicts become Configs. `cfg.__file__` is the .py file
    it was loaded from (None for a dict), for error messages."""

    def __init__(self, data: Mapping[str, Any] | None = None, **kwargs: Any):
        super().__init__()
        # an instance attribute, not a key: a config file's dunders never become keys
        self.__dict__["__file__"] = vars(data).get("__file__") if isinstance(data, Config) else None
        for key, value in {**(data or {}), **kwargs}.items():
            self[key] = value

    def __setitem__(self, key: str, value: Any) -> None:
        if isinstance(value, Mapping) and not isinstance(value, Config):
            value = Config(value)
        super().__setitem__(key, value)

    def __getattr__(self, name: str) -> Any:
        if name in self:
            return self[name]
        example = (f"add e.g. {name} = {_EXAMPLES[name]}" if name in _EXAMPLES
                   else f"add a line {name} = ...")
        file = self.__dict__.get("__file__")  # (absent in a copy that skipped __init__)
        if file:
            raise MissingKeyError(f"{file} has no {name}: {example}")
        raise MissingKeyError(f"config has no key {name!r} (keys: {sorted(self)}): {example}")

    def __setattr__(self, name: str, value: Any) -> None:
        self[name] = value

    def __delattr__(self, name: str) -> None:
        del self[name]

    def update(self, other: Mapping[str, Any] = (), **kw: Any) -> None:  # type: ignore[override]
        for key, value in {**dict(other), **kw}.items():
            self[key] = value

    @staticmethod
    def from_file(path: Union[str, os.PathLike]) -> "Config":
        """Run a .py config file and keep its globals (not modules, classes or dunders)."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"config file {str(path)!r} not found "
                                    f"(working directory {os.getcwd()})")
        if path.suffix != ".py":
            raise ConfigError(f"config file {str(path)!r} must be a Python file ending in .py")
        try:
            namespace = runpy.run_path(str(path), run_name="__nanocolossal_config__")
        except SyntaxError as e:
            line = (e.text or "").rstrip()
            raise ConfigError(f"syntax error in config file {e.filename}, line {e.lineno}: "
                              f"{e.msg}\n    {line}") from None
        except Exception as e:
            raise ConfigError(f"config file {str(path)!r} raised {type(e).__name__}: {e}") from e
        cfg = Config({k: v for k, v in namespace.items() if not k.startswith("__")
                      and not inspect.ismodule(v) and not inspect.isclass(v)})
        cfg.__dict__["__file__"] = str(path)  # as the user wrote it, e.g. configs/x.py
        return cfg


class AMP_TYPE(Enum):
    TORCH = "torch"
    APEX = "apex"
    NAIVE = "naive"

    @classmethod
    def parse(cls, mode: "AMP_TYPE | str") -> "AMP_TYPE":
        """Accept an AMP_TYPE or its string value; anything else is a ValueError."""
        if isinstance(mode, cls):
            return mode
        for member in cls:
            if isinstance(mode, str) and mode.lower() in (member.value, member.name.lower()):
                return member
        choices = ", ".join(f"AMP_TYPE.{m.name}" for m in cls)
        raise ValueError(f"unknown fp16 mode {mode!r}; use one of {choices}")


ConfigLike = Union[str, os.PathLike, Mapping[str, Any], Config, None]


def load_config(config: ConfigLike, **overrides: Any) -> Config:
    """A path to a .py file, a dict, a Config or None (empty) -> a validated Config.

    Each override that is not None replaces its key; a dict is merged into the key's dict. This
    is how every script lets its flags override named keys of its config file:

        load_config(args.config, NUM_EPOCHS=args.epochs, parallel=dict(pipeline=args.pipeline))
    """
    for hook in ON_LOAD:  # launch_checks' hook: a bad config ends a script in one line per rank
        hook()
    if isinstance(config, (str, os.PathLike)):
        cfg = Config.from_file(config)
    elif config is None or isinstance(config, Mapping):
        cfg = Config(config)
    else:
        raise ConfigError(f"config must be a path to a .py file, a dict or a Config, not "
                          f"{type(config).__name__}")
    for key, value in overrides.items():
        if isinstance(value, Mapping):  # a flag for one nested entry, e.g. parallel.pipeline
            value = {**cfg.get(key, {}), **{k: v for k, v in value.items() if v is not None}}
        if value is not None:
            cfg[key] = value
    for check in CHECKS:  # config_checks.validate_config: every section's check, in order
        check(cfg)
    return cfg


# What load_config runs before it loads (ON_LOAD) and on what it loaded (CHECKS), appended by the
# package's __init__ at the first load: config_checks.validate_config (the checks import the
# features, which import this module) and launch_checks' user-error hook.
ON_LOAD: list[Callable[[], None]] = []
CHECKS: list[Callable[[Config], None]] = []


def is_positive_int(value: Any) -> bool:
    """1, 2, 3, ... (not True: a bool is an int in Python; not 2.0)."""
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def size_of(value: Any) -> int:
    """`tensor=4` and `tensor=dict(size=4, mode='2d')` are both Colossal-AI spellings."""
    return value.get("size", 1) if isinstance(value, Mapping) else value


def parallel_settings(cfg: Mapping) -> tuple[int, int, Optional[str], Optional[int], int]:
    """`parallel` -> (pipeline size P, tensor size T, tensor mode or None, data size or None,
    2.5d's depth or 1). The refusals ran when the config was loaded (config_checks.py)."""
    parallel = cfg.get("parallel") or {}
    tensor = parallel.get("tensor", 1)
    T = size_of(tensor)
    mode = tensor.get("mode") if T > 1 and isinstance(tensor, Mapping) else None
    depth = tensor.get("depth", 1) if mode == "2.5d" else 1
    P = size_of(parallel.get("pipeline", 1))
    data = parallel.get("data")
    return P, T, mode, None if data is None else size_of(data), depth


def ep_size(cfg: Mapping) -> int:
    """EP, the expert-parallel size: parallel.moe, as dict(size=EP) or EP; 1 without it."""
    return size_of((cfg.get("parallel") or {}).get("moe", 1))
