"""gpc: the global parallel context -- who am I, who are my peers, which groups do I talk in.

Who is who -- the rank arithmetic, W = D * P * T, and which ranks form each group -- is
layout.py's; gpc creates those groups on every rank and answers for this one: `gpc.data_rank`,
`gpc.pipeline_group`, `gpc.tensor_row_group`, ...

Gradients are all-reduced in the gradient group; activations travel along the pipeline group;
every layer's collectives run in the tensor group (or its rows and columns).

Before `launch`, gpc describes one process (rank 0 of 1, CPU) so single-process code works.
`gpc.destroy()` ends a job: the groups, gpc's fields, and what other modules remember for the
job (each registers its reset with `on_destroy`), so that a second job in the same process starts
as a fresh one would.
"""
from __future__ import annotations

import math
import os
from datetime import timedelta
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .config import Config, ep_size, parallel_settings
from .layout import GROUPS, coordinates, ep_layout, layout


class ParallelContext:
    """This process's place in the job. The class attributes are the one-process defaults
    (every group's are set below the class); `init` sets a job's own, `destroy` drops them."""

    rank = 0
    world_size = 1
    local_rank = 0
    device = torch.device("cpu")
    backend: Optional[str] = None
    timeout = timedelta(seconds=300)
    pipeline_size = 1
    pipeline_rank = 0
    data_size = 1
    data_rank = 0
    tensor_size = 1
    tensor_rank = 0
    tensor_mode: Optional[str] = None
    # sequence parallelism (mode='sequence'): its N ranks take the tensor ranks' place
    sequence_size = 1
    sequence_rank = 0
    # 2d, 2.5d: my place in grid `grid_depth` of `tensor_depth` stacked q x q grids; as
    # Colossal-AI, my index IN my row group is `tensor_row_rank` (= grid_col), and vice versa
    summa_dim = 1
    tensor_depth = 1
    grid_depth = grid_row = grid_col = 0
    tensor_row_rank = tensor_col_rank = 0
    # 3d: my place in the q x q x q cube
    cube_dim = 1
    cube_x = cube_y = cube_z = 0
    # expert parallelism (parallel.moe): my place in my EP group, and per G (peers: moe/
    # placement.py) the data ranks that hold the same experts as I do (moe/grads.py sums there)
    ep_size = 1
    ep_rank = 0
    expert_data_groups: dict[int, tuple[Optional[dist.ProcessGroup], list[int]]] = {}

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.__dict__.clear()  # the class's defaults show again
        self.config = Config()
        # sharded dropout's own generators (tensor/base.py): per job, so a relaunch reseeds them
        self.dropout_generators: dict[torch.device, torch.Generator] = {}
        self._job_env: list[str] = []  # environment variables this job set (set_job_env)

    # -- set-up -------------------------------------------------------------------------
    def init(self, config: Config, rank: int, world_size: int, local_rank: int,
             device: torch.device, backend: str, timeout: timedelta) -> None:
        """Record this process's place and build the groups of its layout (collective)."""
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        self.device = device
        self.backend = backend
        self.timeout = timeout
        P, T, mode, _, depth = parallel_settings(config)
        self.pipeline_size = P
        self.tensor_size = T
        self.tensor_mode = mode
        self.data_size = world_size // (P * T)
        self.data_rank, self.pipeline_rank, self.tensor_rank = coordinates(rank, P, T)
        self.ep_size = ep_size(config)
        groups = layout(world_size, P, T, mode, depth=depth)
        # every rank creates every group, in the same order; each keeps the ones it is in
        for name in GROUPS:
            for ranks in getattr(groups, name):
                group = self._new_group(ranks)
                if rank in ranks:
                    setattr(self, f"{name}_group", group)
                    setattr(self, f"{name}_ranks", ranks)
        if mode == "sequence":
            self._init_sequence()
        else:  # the ranks holding my parameters are my data group
            self.gradient_group = self.data_group
            self.gradient_ranks = self.data_ranks
        if mode in ("2d", "2.5d"):
            self._init_grid(depth)
        if mode == "3d":
            self._init_cube()
        if self.ep_size > 1:
            self._init_experts(groups.data)

    def _init_sequence(self) -> None:
        """The tensor group's ranks split each sequence (sequence.py)."""
        self.sequence_size = self.tensor_size
        self.sequence_rank = self.tensor_rank
        self.sequence_group = self.tensor_group
        self.sequence_ranks = self.tensor_ranks

    def _init_grid(self, depth: int) -> None:
        q = math.isqrt(self.tensor_size // depth)
        self.tensor_depth = depth
        self.summa_dim = q
        self.grid_depth, in_grid = divmod(self.tensor_rank, q * q)
        self.grid_row, self.grid_col = divmod(in_grid, q)
        self.tensor_row_rank = self.grid_col  # my index IN my row group (the class's comment)
        self.tensor_col_rank = self.grid_row
        if depth == 1:  # 2d: the ranks splitting the batch are my column
            self.tensor_batch_group = self.tensor_col_group
            self.tensor_batch_ranks = self.tensor_col_ranks

    def _init_cube(self) -> None:
        q = self.cube_dim = round(self.tensor_size ** (1 / 3))
        t = self.tensor_rank
        self.cube_x = t // (q * q)
        self.cube_y = t // q % q
        self.cube_z = t % q

    def _init_experts(self, data: list[list[int]]) -> None:
        eps, holders = ep_layout(data, self.ep_size)
        for ranks in eps:
            group = self._new_group(ranks)
            if self.rank in ranks:
                self.ep_group = group
                self.ep_ranks = ranks
                self.ep_rank = ranks.index(self.rank)
        self.expert_data_groups = {}
        for g, lists in holders.items():
            for ranks in lists:
                group = self._new_group(ranks) if len(ranks) > 1 else None
                if self.rank in ranks:
                    self.expert_data_groups[g] = (group, ranks)

    def _new_group(self, ranks: list[int]) -> dist.ProcessGroup:
        if len(ranks) == self.world_size:
            return dist.group.WORLD
        return dist.new_group(ranks, timeout=self.timeout, backend=self.backend)

    def set_job_env(self, name: str, value: str) -> None:
        """os.environ[name] = value for this job, unless the user set it; destroy() removes it."""
        if name not in os.environ:
            os.environ[name] = value
            self._job_env.append(name)

    def destroy(self) -> None:
        """End the job: the process groups, all the job set; back to the one-process defaults."""
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        for name in self._job_env:
            os.environ.pop(name, None)
        for reset in _JOB_STATE_RESETS:  # what other modules remember for the job (on_destroy)
            reset()
        self._reset()

    # -- queries ------------------------------------------------------------------------
    @property
    def is_initialized(self) -> bool:
        return dist.is_available() and dist.is_initialized() and self.backend is not None

    def get_global_rank(self) -> int:
        """Colossal-AI's spelling of `gpc.rank`, kept so tutorial code ports unchanged."""
        return self.rank

    @property
    def other_parts_group(self) -> Optional[dist.ProcessGroup]:
        """The ranks holding the *other* parts of my replica (pipeline stages, tensor slices),
        whose squares a global gradient norm adds: the model group, but the pipeline group under
        sequence parallelism (sequence ranks hold replicas, as data ranks do)."""
        return self.pipeline_group if self.sequence_size > 1 else self.model_group

    @property
    def gradient_size(self) -> int:
        """How many ranks average each gradient: data x sequence."""
        return len(self.gradient_ranks)

    @property
    def gradient_rank(self) -> int:
        return self.gradient_ranks.index(self.rank)

    def is_first_stage(self) -> bool:
        return self.pipeline_rank == 0

    def is_last_stage(self) -> bool:
        return self.pipeline_rank == self.pipeline_size - 1

    @property
    def prev_rank(self) -> int:
        """Global rank of the previous stage (the ring wraps, as interleaved 1F1B needs)."""
        return self.pipeline_ranks[(self.pipeline_rank - 1) % self.pipeline_size]

    @property
    def next_rank(self) -> int:
        """Global rank of the next stage (the last stage's next is the first)."""
        return self.pipeline_ranks[(self.pipeline_rank + 1) % self.pipeline_size]

    def __repr__(self) -> str:
        return (f"ParallelContext(rank={self.rank}/{self.world_size}, local_rank={self.local_rank}"
                f", device={self.device}, pipeline={self.pipeline_rank}/{self.pipeline_size}, "
                f"tensor={self.tensor_rank}/{self.tensor_size} {self.tensor_mode or ''}, "
                f"data={self.data_rank}/{self.data_size})")


_JOB_STATE_RESETS: list[Callable[[], None]] = []


def on_destroy(reset: Callable[[], None]) -> None:
    """Register a module's reset of what it remembers for one job (gpc.destroy() runs them)."""
    _JOB_STATE_RESETS.append(reset)


# for every group of layout.py's GROUPS, and the sequence and EP groups: gpc.<name>_group (None
# before launch) and gpc.<name>_ranks (the global ranks of mine, in order; [0] before launch)
for _name in (*GROUPS, "sequence", "ep"):
    setattr(ParallelContext, f"{_name}_group", None)
    setattr(ParallelContext, f"{_name}_ranks", [0])

gpc = ParallelContext()
