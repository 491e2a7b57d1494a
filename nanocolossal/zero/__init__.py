"""ZeRO: shard over the data-parallel ranks what plain data parallelism replicates.

Level 1 shards the optimizer state, level 2 also the gradients (optimizer.py explains both and
their memory and traffic; gradients.py is level 2's backward; mixed.py the fp32 master shards
under AMP O2), level 3 also the parameters
(sharded_model.py: the gather / free / reduce-scatter timeline; sharded_params.py: the shards;
unit_order.py: which modules are units, and the rules they follow; sharded_model_checks.py:
those rules enforced beside the timeline; state_dict.py: the model's state_dict made whole).
state.py: checkpoints, the plain optimizer's state put together from every rank's segments;
load.py: a rank reads only the files with its own. comm.py: the collectives ZeRO adds;
settings.py: the zero=dict(...) config; offload.py: masters and optimizer state in CPU memory,
the step on the CPU (offload='cpu').
Turned on by the config:

    zero = dict(level=2, reduce_bucket_size_mb=25, overlap_communication=True)

and applied by `nc.initialize` (engine/initialize.py: apply_zero); the Engine's calls are
unchanged. Colossal-AI v0.1's zero=dict(model_config=..., optimizer_config=...) is level 3
(settings.py says which of its keys mean something here).
"""
from .gradients import ShardKeepingDDP
from .mixed import MixedShardedOptimizer
from .offload import Offload
from .optimizer import FlatBuffer, Segment, ShardedOptimizer
from .settings import ELEMENTWISE, ZERO_KEYS, zero_settings
from .sharded_model import ShardedModel, plan_units
from .sharded_params import ParamShardedOptimizer, ShardedFlatBuffer

__all__ = ["ELEMENTWISE", "ZERO_KEYS", "FlatBuffer", "MixedShardedOptimizer", "Offload",
           "ParamShardedOptimizer", "ShardKeepingDDP",
           "Segment", "ShardedFlatBuffer", "ShardedModel", "ShardedOptimizer",
           "plan_units", "zero_settings"]
