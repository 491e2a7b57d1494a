"""gpc: the global parallel context -- who am I, who are my peers, which groups do I talk in.

With pipeline size P and W processes there are D = W // P data-parallel replicas of a
P-stage pipeline. Ranks are laid out as in Colossal-AI, so the stages of one pipeline are
consecutive ranks:

    rank = data_rank * P + pipeline_rank                       (W = 8, P = 2, D = 4)

                  pipeline_rank 0   pipeline_rank 1
    data_rank 0       rank 0    ->      rank 1        <- one pipeline group: {0, 1}
    data_rank 1       rank 2    ->      rank 3
    data_rank 2       rank 4    ->      rank 5
    data_rank 3       rank 6    ->      rank 7
                        ^
                        one data group: {0, 2, 4, 6} (same stage, different data)

Gradients are all-reduced in the data group of one's stage; activations travel along the
pipeline group. `torch.distributed.new_group` must be called by *every* rank for *every*
group in the same order, even for groups a rank is not in, so `init` builds all of them.

Before `launch`, gpc describes one process (rank 0 of 1, CPU) so single-process code works.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from .config import Config, ConfigError


class ParallelContext:
    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.config: Config = Config()
        self.rank, self.world_size, self.local_rank = 0, 1, 0
        self.device = torch.device("cpu")
        self.backend: Optional[str] = None
        self.timeout = timedelta(seconds=300)
        self.pipeline_size, self.pipeline_rank = 1, 0
        self.data_size, self.data_rank = 1, 0
        self.pipeline_group: Optional[dist.ProcessGroup] = None
        self.data_group: Optional[dist.ProcessGroup] = None
        self.pipeline_ranks: list[int] = [0]   # global ranks of my pipeline, stage order
        self.data_ranks: list[int] = [0]       # global ranks holding my stage, data order

    # -- set-up -------------------------------------------------------------------------
    @staticmethod
    def parallel_sizes(config: Config, world_size: int) -> tuple[int, int]:
        """(pipeline_size, data_size) for this world; ConfigError if they do not fit."""
        parallel = config.get("parallel") or {}
        pipeline = parallel.get("pipeline", 1)
        pipeline = pipeline.get("size", 1) if isinstance(pipeline, dict) else pipeline
        if world_size % pipeline != 0:
            raise ConfigError(f"world size {world_size} is not divisible by parallel.pipeline={pipeline}; "
                              f"launch a multiple of {pipeline} processes or change parallel.pipeline")
        data = world_size // pipeline
        wanted = parallel.get("data")
        wanted = wanted.get("size") if isinstance(wanted, dict) else wanted
        if wanted is not None and wanted != data:
            raise ConfigError(f"parallel.data={wanted} but world size {world_size} // pipeline {pipeline} = {data}; "
                              f"drop parallel.data (it is inferred) or launch {wanted * pipeline} processes")
        return pipeline, data

    def init(self, config: Config, rank: int, world_size: int, local_rank: int,
             device: torch.device, backend: str, timeout: timedelta) -> None:
        """Record this process's place and build the data and pipeline groups (collective)."""
        self.config, self.device, self.backend, self.timeout = config, device, backend, timeout
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        P, D = self.parallel_sizes(config, world_size)
        self.pipeline_size, self.data_size = P, D
        self.data_rank, self.pipeline_rank = divmod(rank, P)
        for p in range(P):
            ranks = [d * P + p for d in range(D)]
            group = self._new_group(ranks)
            if p == self.pipeline_rank:
                self.data_group, self.data_ranks = group, ranks
        for d in range(D):
            ranks = [d * P + p for p in range(P)]
            group = self._new_group(ranks)
            if d == self.data_rank:
                self.pipeline_group, self.pipeline_ranks = group, ranks

    def _new_group(self, ranks: list[int]) -> dist.ProcessGroup:
        if len(ranks) == self.world_size:
            return dist.group.WORLD
        return dist.new_group(ranks, timeout=self.timeout, backend=self.backend)

    def destroy(self) -> None:
        """Tear down the process groups and return to the single-process defaults."""
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        self._reset()

    # -- queries ------------------------------------------------------------------------
    @property
    def is_initialized(self) -> bool:
        return dist.is_available() and dist.is_initialized() and self.backend is not None

    def get_global_rank(self) -> int:
        """Colossal-AI's spelling of `gpc.rank`, kept so tutorial code ports unchanged."""
        return self.rank

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
        return (f"ParallelContext(rank={self.rank}/{self.world_size}, local_rank={self.local_rank}, "
                f"device={self.device}, pipeline={self.pipeline_rank}/{self.pipeline_size}, "
                f"data={self.data_rank}/{self.data_size})")


gpc = ParallelContext()
