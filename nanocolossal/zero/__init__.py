"""ZeRO: shard over the data-parallel ranks what plain data parallelism replicates, turned on
by zero=dict(level=1|2|3, ...) and applied by `nc.initialize` (engine/initialize.py: apply_zero).

Level 1 shards the optimizer state (optimizer.py), level 2 also the gradients (gradients.py),
level 3 also the parameters (sharded_model.py, sharded_params.py; its rules:
sharded_model_checks.py). mixed.py: O2's fp32 masters of my shard; offload.py: them in CPU memory;
comm.py: the collectives. The config: config_checks.py. Checkpoints: checkpoint/zero.py.
"""
from ..config_checks import ZERO_KEYS, zero_settings
from .gradients import ShardKeepingDDP
from .mixed import MixedShardedOptimizer
from .offload import Offload
from .optimizer import FlatBuffer, Segment, ShardedOptimizer
from .optimizer_checks import ELEMENTWISE
from .sharded_model import ShardedModel, plan_units
from .sharded_params import ParamShardedOptimizer, ShardedFlatBuffer

__all__ = ["ELEMENTWISE", "ZERO_KEYS", "FlatBuffer", "MixedShardedOptimizer", "Offload",
           "ParamShardedOptimizer", "Segment", "ShardKeepingDDP", "ShardedFlatBuffer",
           "ShardedModel", "ShardedOptimizer", "plan_units", "zero_settings"]
