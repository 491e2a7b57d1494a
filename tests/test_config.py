import copy as copy_module
import pickle
import textwrap

import pytest

from nanocolossal.amp import AMP_TYPE
from nanocolossal.config import (
    Config,
    ConfigError,
    MissingKeyError,
    is_positive_int,
    load_config,
)


def write(tmp_path, text, name="config.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_config_attribute_access_and_nested_dicts():
    cfg = Config({"BATCH_SIZE": 8, "parallel": {"pipeline": 2}})
    assert cfg.BATCH_SIZE == 8 and cfg["BATCH_SIZE"] == 8
    assert isinstance(cfg.parallel, Config) and cfg.parallel.pipeline == 2
    cfg.fp16 = {"mode": AMP_TYPE.TORCH}
    assert cfg.fp16.mode is AMP_TYPE.TORCH
    with pytest.raises(AttributeError, match="no key 'missing'"):
        cfg.missing


def test_load_config_from_python_file_keeps_globals_not_modules_or_classes(tmp_path):
    path = write(tmp_path, """
        import os
        from nanocolossal.amp import AMP_TYPE
        BATCH_SIZE = 128
        learning_rate = 3e-3
        parallel = dict(pipeline=2)
        fp16 = dict(mode=AMP_TYPE.TORCH)
        _scratch = BATCH_SIZE * 2
    """)
    cfg = load_config(str(path))
    assert cfg.BATCH_SIZE == 128 and cfg.learning_rate == 3e-3 and cfg._scratch == 256
    assert cfg.parallel.pipeline == 2 and cfg.fp16.mode is AMP_TYPE.TORCH
    assert "os" not in cfg and "AMP_TYPE" not in cfg and "__builtins__" not in cfg
    assert load_config(path) == cfg  # pathlib paths work too


def test_load_config_from_dict_and_config():
    cfg = load_config({"NUM_EPOCHS": 2, "fp16": {"mode": "torch"}})
    assert cfg.NUM_EPOCHS == 2 and cfg.fp16.mode == "torch"
    assert load_config(cfg) == cfg
    assert load_config(None) == Config()


def test_missing_config_file_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.py"):
        load_config(str(tmp_path / "nope.py"))


def test_config_syntax_error_shows_file_and_line(tmp_path):
    path = write(tmp_path, "BATCH_SIZE = 8\nparallel = dict(pipeline=2\nNUM_EPOCHS = 1\n")
    with pytest.raises(ConfigError, match=r"config\.py, line [23]"):
        load_config(str(path))


def test_config_file_that_raises_is_reported(tmp_path):
    path = write(tmp_path, "BATCH_SIZE = undefined_name\n")
    with pytest.raises(ConfigError, match="NameError.*undefined_name"):
        load_config(str(path))


@pytest.mark.parametrize("config, message", [
    ({"zero": {"level": 4}}, "zero level must be 1, 2 or 3"),
    ({"gradient_handler": [dict(type="X")]},
     r"gradient_handler \['X'\] is not supported.*DataParallelGradientHandler"),
    ({"parallel": {"tensor": {"size": 8, "mode": "2d"}}},
     "size 8 is not a perfect square.*use size 4 or 9"),
    ({"parallel": {"tensor": {"size": 2, "mode": "2d"}}},
     "size 2 is not a perfect square.*use size 1 or 4"),
    ({"parallel": {"tensor": 2}},
     "parallel.tensor needs mode='1d', '2d', '2.5d', '3d' or 'sequence'"),
    ({"parallel": {"tensor": {"size": 4, "mode": "2.5d"}}},
     r"mode='2.5d' needs depth.*got None; e.g. tensor=dict\(size=4, mode='2.5d', depth=2\)"),
    ({"parallel": {"tensor": {"size": 4, "mode": "3d"}}},
     "size 4 is not a cube, which mode='3d' needs.*use size 1 or 8"),
    ({"parallel": {"sequence": 2}},
     r"tensor=dict\(size=N, mode='sequence'\).*not with a 1d/2d tensor split"),
    ({"parallel": {"sequence": 2, "tensor": {"size": 2, "mode": "1d"}}},
     "remove parallel.sequence"),
    ({"parallel": {"pipline": 2}}, r"unknown parallel key\(s\) \['pipline'\]; supported: "
     r"pipeline, data, tensor, sequence, moe"),
    ({"parallel": {"tensor": {"size": 1, "mode": "1-d"}}},
     r"parallel.tensor needs mode='1d', .* \(got '1-d'\)"),
    ({"parallel": {"tensor": {"size": 2, "mode": ["1d"]}}},
     r"parallel.tensor mode must be a string such as '1d', got \['1d'\]"),
    ({"parallel": {"tensor": {"size": 2, "mode": "sequence", "attention": "bogus", "foo": 3}}},
     r"unknown parallel.tensor key\(s\) \['foo'\]; parallel.tensor understands "
     r"size, mode, attention"),
    ({"parallel": {"tensor": {"size": 4, "mode": "2d", "depht": 2}}},
     r"unknown parallel.tensor key\(s\) \['depht'\]"),
    ({"parallel": {"tensor": {"size": 8, "mode": "2.5d", "depth": 3}}},
     r"size 8 is not q \* q \* depth for depth 3, which mode='2.5d' needs \(3 stacked q x q "
     r"grids\); use size 3 or 12"),
    ({"parallel": {"tensor": {"size": 12, "mode": "2.5d", "depth": 2}}},
     r"size 12 is not q \* q \* depth for depth 2.*use size 8 or 18"),
    ({"parallel": {"pipeline": {"size": 2, "chunks": 2}}},
     r"unknown parallel.pipeline key\(s\) \['chunks'\]; parallel.pipeline understands size"),
    ({"parallel": {"data": {"szie": 2}}}, r"unknown parallel.data key\(s\) \['szie'\]"),
    ({"gradient_handler": [{"type": "DataParallelGradientHandler", "bucket": 4}]},
     r"gradient_handler entries take only type.*unknown: bucket"),
    ({"parallel": {"pipeline": 2}, "zero": {"level": 3}},
     r"zero level 3 with a pipeline \(pipeline=2\) is not supported.*use zero level 1 or 2"),
    ({"parallel": {"pipeline": 0}}, "parallel.pipeline must be a positive integer"),
    ({"parallel": 2}, "parallel must be a dict"),
    ({"fp16": {"mode": "fp8"}}, "unknown fp16 mode 'fp8'.*AMP_TYPE.TORCH"),
    ({"fp16": {}}, "fp16 must be a dict with a mode"),
    ({"fp16": {"mode": AMP_TYPE.NAIVE, "clip_grad_norm": 1.0}},
     "fp16.clip_grad_norm has no effect with mode=AMP_TYPE.NAIVE: set clip_grad_norm at the top"),
    ({"fp16": {"mode": AMP_TYPE.NAIVE, "verbose": True}}, "fp16.verbose has no effect.*remove it"),
    ({"fp16": {"mode": AMP_TYPE.APEX, "num_losses": 2}}, "fp16.num_losses has no effect"),
    ({"fp16": {"mode": AMP_TYPE.TORCH, "opt_level": "O2"}},
     "fp16.opt_level has no effect with mode=AMP_TYPE.TORCH: TORCH takes .*init_scale"),
    ({"fp16": {"mode": AMP_TYPE.TORCH, "initial_sclae": 8}}, "fp16.initial_sclae has no effect"),
    ({"fp16": {"mode": AMP_TYPE.APEX, "opt_level": "O3", "master_weights": True}},
     "master_weights=True with opt_level O3: here only O2 keeps fp32 master weights"),
    ({"fp16": {"mode": AMP_TYPE.TORCH, "dtype": "float8"}}, "fp16.dtype must be 'float16' or"),
    ({"gradient_accumulation": 0}, "gradient_accumulation must be a positive integer"),
    ({"NUM_MICRO_BATCHES": 2.5}, "NUM_MICRO_BATCHES must be a positive integer"),
    ({"clip_grad_norm": -1.0}, "clip_grad_norm must be a positive number"),
    ({"timeout": "10"}, "timeout must be a positive number"),
    ({"PIPELINE_SCHEDULE": "zigzag"}, "PIPELINE_SCHEDULE must be one of 'gpipe', '1f1b', "
     "'interleaved', 'zero_bubble', 'zbv', got 'zigzag'"),
    ({"TENSOR_SHAPE": (16, "x")}, "TENSOR_SHAPE must be a non-empty list of positive ints"),
    ({"TENSOR_SHAPE": ()}, r"TENSOR_SHAPE must be a non-empty list of positive ints .*got \(\)"),
])
def test_unsupported_or_bad_config_is_a_clear_error(config, message):
    with pytest.raises(ConfigError, match=message):
        load_config(config)


def test_supported_spellings_pass():
    load_config({"parallel": {"pipeline": 2, "tensor": {"size": 1, "mode": None}},
                 "fp16": {"mode": AMP_TYPE.NAIVE},
                 "gradient_accumulation": 4, "clip_grad_norm": 1.0, "timeout": 30})
    for fp16 in ({"mode": AMP_TYPE.APEX, "opt_level": "O2", "min_loss_scale": 1.0,
                  "max_loss_scale": 2.0 ** 16, "keep_batchnorm_fp32": True, "master_weights": True,
                  "loss_scale": "dynamic", "enabled": True},
                 {"mode": AMP_TYPE.NAIVE, "initial_scale": 2.0 ** 8, "hysteresis": 2,
                  "min_scale": 1.0, "max_scale": 2.0 ** 20, "growth_interval": 100},
                 {"mode": AMP_TYPE.TORCH, "init_scale": 2.0 ** 8, "growth_factor": 2.0,
                  "backoff_factor": 0.5, "growth_interval": 100, "enabled": False}):
        load_config({"fp16": fp16})  # each backend's own keys
    # the tutorial's line
    load_config({"parallel": {"pipeline": 2, "tensor": {"size": 4, "mode": "2d"}}})
    load_config({"parallel": {"tensor": {"size": 2, "mode": "1d"}}})


def test_config_file_must_be_python(tmp_path):
    path = write(tmp_path, "BATCH_SIZE: 8\n", name="config.yaml")
    with pytest.raises(ConfigError, match="must be a Python file"):
        load_config(str(path))


def test_flags_override_named_keys_of_the_config_file(tmp_path):
    path = tmp_path / "config.py"
    path.write_text("BATCH_SIZE = 64\nNUM_EPOCHS = 3\nparallel = dict(pipeline=2, "
                    "tensor=dict(size=2, mode='1d'))\n")
    cfg = load_config(str(path), NUM_EPOCHS=5, BATCH_SIZE=None, debug=None,
                      parallel=dict(pipeline=1, data=None))
    # None: the flag was not given
    assert cfg.NUM_EPOCHS == 5 and cfg.BATCH_SIZE == 64 and "debug" not in cfg
    # merged, not replaced
    assert cfg.parallel == {"pipeline": 1, "tensor": {"size": 2, "mode": "1d"}}
    with pytest.raises(ConfigError, match="NUM_MICRO_BATCHES must be a positive integer"):
        load_config(str(path), NUM_MICRO_BATCHES=0)  # overrides are validated like the file


@pytest.mark.parametrize("ddp, message",
                         [({"compress": "int8"}, "ddp.compress must be None, 'bf16' or 'fp16'"),
                          ({"bucket_mb": 4}, r"unknown: bucket_mb"),
                          ([1], "ddp must be a dict of bucket_cap_mb")])
def test_bad_ddp_options_are_named(ddp, message):
    with pytest.raises(ConfigError, match=message):
        load_config({"ddp": ddp})


@pytest.mark.parametrize("instead, named", [
    ({"gradient_handler": [{"type": "DataParallelGradientHandler"}]}, "gradient_handler"),
    ({"zero": {"level": 2}}, "zero level 2"),
    ({"zero": {"level": 3}}, "zero level 3"),
    ({"zero": {"model_config": {}, "optimizer_config": {}}}, "zero level 3")])  # v0.1's
def test_ddp_options_where_no_ddp_runs_are_refused_not_ignored(instead, named):
    with pytest.raises(ConfigError, match=f"but {named} reduces the gradients without DDP"):
        load_config({"ddp": {"compress": "bf16"}, **instead})
    load_config({"ddp": {"compress": "bf16"}, "zero": {"level": 1}})  # level 1 is DDP


def test_a_key_the_config_file_lacks_names_the_file_and_what_to_add(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").mkdir()
    write(tmp_path / "configs", "BATCH_SIZE = 8\n", name="x.py")
    cfg = load_config("configs/x.py")
    with pytest.raises(MissingKeyError) as info:
        cfg.NUM_EPOCHS
    assert str(info.value) == "configs/x.py has no NUM_EPOCHS: add e.g. NUM_EPOCHS = 10"
    with pytest.raises(ConfigError, match="configs/x.py has no LR: add a line LR = ..."):
        cfg.LR  # a user error like any bad config; a key without a known example
    # an AttributeError too: the usual ways to ask for an optional key still work
    assert not hasattr(cfg, "NUM_EPOCHS") and getattr(cfg, "NUM_EPOCHS", 3) == 3
    # the file is remembered through launch's copy, deepcopy and pickle, and is not a key
    for copy in (load_config(cfg), copy_module.deepcopy(cfg), pickle.loads(pickle.dumps(cfg))):
        assert copy == {"BATCH_SIZE": 8} and copy.__file__ == "configs/x.py"
    with pytest.raises(MissingKeyError, match=r"config has no key 'NUM_EPOCHS' \(keys: "
                                              r"\['BATCH_SIZE'\]\): add e.g. NUM_EPOCHS = 10"):
        load_config({"BATCH_SIZE": 8}).NUM_EPOCHS  # a dict: no file to name


def test_is_positive_int_is_the_one_test_of_counts():
    assert [is_positive_int(v) for v in (1, 7, 0, -1, 2.0, True, "3", None)] == \
        [True, True, False, False, False, False, False, False]
