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

from .config import Config, ConfigError, moe_size, parallel_settings
from .layout import check_moe_world, coordinates, data_size, layout


class ParallelContext:
    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.config: Config = Config()
        self.rank = 0
        self.world_size = 1
        self.local_rank = 0
        self.device = torch.device("cpu")
        self.backend: Optional[str] = None
        self.timeout = timedelta(seconds=300)
        self.pipeline_size = 1
        self.pipeline_rank = 0
        self.data_size = 1
        self.data_rank = 0
        self.pipeline_group: Optional[dist.ProcessGroup] = None
        self.data_group: Optional[dist.ProcessGroup] = None
        self.pipeline_ranks: list[int] = [0]   # global ranks of my pipeline, stage order
        self.data_ranks: list[int] = [0]       # global ranks holding my stage, data order
        self.tensor_size = 1
        self.tensor_rank = 0
        self.tensor_mode: Optional[str] = None
        self.tensor_group: Optional[dist.ProcessGroup] = None
        self.tensor_ranks: list[int] = [0]
        self.tensor_row_group: Optional[dist.ProcessGroup] = None   # 2d and 2.5d
        self.tensor_col_group: Optional[dist.ProcessGroup] = None
        # 2d, 2.5d: my place in the q x q grid
        self.grid_row = 0
        self.grid_col = 0
        self.summa_dim = 1
        # 2.5d: `tensor_depth` stacked grids; mine is number grid_depth; the depth group holds
        # my weight blocks in every grid
        self.tensor_depth = 1
        self.grid_depth = 0
        self.tensor_depth_group: Optional[dist.ProcessGroup] = None
        self.tensor_depth_ranks: list[int] = [0]
        # 2d, 2.5d: the ranks splitting the batch that hold the same features (my column of
        # every grid, grid-major): a batch's blocks, the sums of losses and of replicated
        # parameters' gradients run here (2d: the column group itself)
        self.tensor_batch_group: Optional[dist.ProcessGroup] = None
        self.tensor_batch_ranks: list[int] = [0]
        # 3d: my place in the q x q x q cube, and the groups along each of its axes
        self.cube_dim = 1
        self.cube_x = 0
        self.cube_y = 0
        self.cube_z = 0
        self.tensor_x_group: Optional[dist.ProcessGroup] = None
        self.tensor_y_group: Optional[dist.ProcessGroup] = None
        self.tensor_z_group: Optional[dist.ProcessGroup] = None
        self.tensor_x_ranks: list[int] = [0]
        self.tensor_y_ranks: list[int] = [0]
        self.tensor_z_ranks: list[int] = [0]
        # 3d: the planes of the cube through my rank: every (x, y) at my z, every (x, z) at my y
        self.tensor_xy_group: Optional[dist.ProcessGroup] = None
        self.tensor_xz_group: Optional[dist.ProcessGroup] = None
        self.tensor_xy_ranks: list[int] = [0]
        self.tensor_xz_ranks: list[int] = [0]
        # Colossal-AI's names: my index IN my row group (grid_col), IN my column group (grid_row)
        self.tensor_row_rank = 0
        self.tensor_col_rank = 0
        self.tensor_row_ranks: list[int] = [0]
        self.tensor_col_ranks: list[int] = [0]
        # pipeline x tensor ranks of my replica
        self.model_group: Optional[dist.ProcessGroup] = None
        self.model_ranks: list[int] = [0]
        # the ranks holding my parameters: gradients, BatchNorm statistics and buffers meet here
        self.gradient_group: Optional[dist.ProcessGroup] = None
        self.gradient_ranks: list[int] = [0]
        # expert parallelism (parallel.moe): my EP group, and per exchange block G the data
        # ranks that hold the same experts as I do (moe/grads.py sums expert gradients there)
        self.moe_size = 1
        self.ep_rank = 0
        self.ep_group: Optional[dist.ProcessGroup] = None
        self.ep_ranks: list[int] = [0]
        self.expert_data_groups: dict[int, tuple[Optional[dist.ProcessGroup], list[int]]] = {}
        # sharded dropout's own generators (tensor/base.py): per job, so a relaunch reseeds them
        self.dropout_generators: dict[torch.device, torch.Generator] = {}
        self._job_env: list[str] = []  # environment variables this job set (set_job_env)

    # -- set-up -------------------------------------------------------------------------
    @staticmethod
    def parallel_sizes(config: Config, world_size: int) -> tuple[int, int, int, Optional[str]]:
        """(pipeline P, tensor T, data D, tensor mode) for this world, or a ConfigError."""
        P, T, mode, wanted, _ = parallel_settings(config)
        D = data_size(world_size, P, T)
        if wanted is not None and wanted != D:
            raise ConfigError(f"parallel.data={wanted} but world size {world_size} // (pipeline x "
                              f"tensor) = {D}; drop parallel.data (it is inferred) or launch "
                              f"{wanted * P * T} processes")
        check_moe_world(moe_size(config), D, world_size)
        return P, T, D, mode

    def init(self, config: Config, rank: int, world_size: int, local_rank: int,
             device: torch.device, backend: str, timeout: timedelta) -> None:
        """Record this process's place and build every group of the layout (collective)."""
        self.config = config
        self.device = device
        self.backend = backend
        self.timeout = timeout
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        P, T, D, mode = self.parallel_sizes(config, world_size)
        self.pipeline_size = P
        self.tensor_size = T
        self.data_size = D
        self.tensor_mode = mode
        self.data_rank, self.pipeline_rank, self.tensor_rank = coordinates(rank, P, T)
        self.moe_size = moe_size(config)
        depth = parallel_settings(config)[4]
        groups = layout(world_size, P, T, mode, self.moe_size, depth)
        # every rank creates every group, in the same order; each keeps the ones it is in
        for kind in ("data", "pipeline", "tensor", "row", "col", "depth", "batch", "cube_x",
                     "cube_y", "cube_z", "plane_xy", "plane_xz", "model", "gradient"):
            if kind == "gradient" and mode != "sequence":  # the data group itself
                self.gradient_group = self.data_group
                self.gradient_ranks = self.data_ranks
                continue
            for ranks in getattr(groups, kind):
                group = self._new_group(ranks)
                if rank in ranks:
                    name = {"row": "tensor_row", "col": "tensor_col", "depth": "tensor_depth",
                            "batch": "tensor_batch", "cube_x": "tensor_x", "cube_y": "tensor_y",
                            "cube_z": "tensor_z", "plane_xy": "tensor_xy",
                            "plane_xz": "tensor_xz"}.get(kind, kind)
                    setattr(self, f"{name}_group", group)
                    setattr(self, f"{name}_ranks", ranks)
        if mode in ("2d", "2.5d"):
            q = math.isqrt(T // depth)
            self.tensor_depth = depth
            self.summa_dim = q
            self.grid_depth, in_grid = divmod(self.tensor_rank, q * q)
            self.grid_row, self.grid_col = divmod(in_grid, q)
            # as Colossal-AI: the rank *within* my row group is my column index, and vice versa
            self.tensor_row_rank = self.grid_col
            self.tensor_col_rank = self.grid_row
            if depth == 1:
                self.tensor_batch_group = self.tensor_col_group
                self.tensor_batch_ranks = self.tensor_col_ranks
        if mode == "3d":
            q = self.cube_dim = round(T ** (1 / 3))
            t = self.tensor_rank
            self.cube_x = t // (q * q)
            self.cube_y = t // q % q
            self.cube_z = t % q
        for ranks in groups.ep:
            group = self._new_group(ranks)
            if rank in ranks:
                self.ep_group = group
                self.ep_ranks = ranks
                self.ep_rank = ranks.index(rank)
        for g, lists in groups.expert_data.items():
            for ranks in lists:
                group = self._new_group(ranks) if len(ranks) > 1 else None
                if rank in ranks:
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
        """End the job: tear down the process groups, forget everything the job set, and return
        to the single-process defaults."""
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        for name in self._job_env:
            os.environ.pop(name, None)
        _forget_job_state()
        self._reset()

    # -- queries ------------------------------------------------------------------------
    @property
    def is_initialized(self) -> bool:
        return dist.is_available() and dist.is_initialized() and self.backend is not None

    def get_global_rank(self) -> int:
        """Colossal-AI's spelling of `gpc.rank`, kept so tutorial code ports unchanged."""
        return self.rank

    @property
    def sequence_size(self) -> int:
        """N ranks share each sequence (mode='sequence'), else 1."""
        return self.tensor_size if self.tensor_mode == "sequence" else 1

    @property
    def sequence_rank(self) -> int:
        return self.tensor_rank if self.tensor_mode == "sequence" else 0

    @property
    def other_parts_group(self) -> Optional[dist.ProcessGroup]:
        """The ranks holding the *other* parts of my replica (pipeline stages, tensor slices),
        whose squares a global gradient norm adds: the model group, but the pipeline group under
        sequence parallelism (sequence ranks hold replicas, as data ranks do)."""
        return self.pipeline_group if self.sequence_size > 1 else self.model_group

    @property
    def sequence_group(self) -> Optional[dist.ProcessGroup]:
        return self.tensor_group if self.tensor_mode == "sequence" else None

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
        return (f"ParallelContext(rank={self.rank}/{self.world_size}, "
                f"local_rank={self.local_rank}, device={self.device}, "
                f"pipeline={self.pipeline_rank}/{self.pipeline_size}, "
                f"tensor={self.tensor_rank}/{self.tensor_size} {self.tensor_mode or ''}, "
                f"data={self.data_rank}/{self.data_size})")


_JOB_STATE_RESETS: list[Callable[[], None]] = []


def on_destroy(reset: Callable[[], None]) -> None:
    """Register what a module remembers for one job, forgotten by gpc.destroy(): each module
    registers its own reset when it is imported (the context knows none of them)."""
    _JOB_STATE_RESETS.append(reset)


def _forget_job_state() -> None:
    for reset in _JOB_STATE_RESETS:
        reset()


gpc = ParallelContext()
