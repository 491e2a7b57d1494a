"""Who is who: the rank arithmetic of a job, and every group as lists of global ranks.

W processes hold D data-parallel replicas of a P-stage pipeline whose every stage is split
over T tensor-parallel ranks: W = D * P * T. Ranks are laid out as in Colossal-AI, tensor
innermost, so a tensor group (which talks every layer) is consecutive ranks -- on one node:

    rank = data_rank * (P * T) + pipeline_rank * T + tensor_rank

    W = 8, P = 2, T = 2, D = 2   pipeline_rank 0   pipeline_rank 1
                  data_rank 0    ranks 0 1    ->   ranks 2 3        pipeline groups {0,2} {1,3}
                  data_rank 1    ranks 4 5    ->   ranks 6 7        pipeline groups {4,6} {5,7}
                                 ^ tensor group {0,1}
                                 data groups (same stage, same slice): {0,4} {1,5} {2,6} {3,7}

With T = 1 this is `data_rank * P + pipeline_rank`. For mode='2d' the T = q * q tensor ranks form a
q x q grid, tensor_rank = row * q + col: a *row group* (same row, every col) splits the hidden
dimension, a *column group* (same col, every row) splits the batch. mode='2.5d' stacks `depth` such
grids, tensor_rank = grid_depth * q * q + row * q + col: rows and columns are each grid's own, and a
*depth group* (same row and col, every grid) holds the same weight tiles for different samples.
mode='3d' is a q x q x q cube, tensor_rank = cube_x * q * q + cube_y * q + cube_z, with one group
along each axis (tensor/cube.py says what each axis splits).
For mode='sequence' the T ranks of a "tensor" group split every *sequence* instead
(sequence.py): they hold the same parameters and different tokens, so their gradients are
averaged together with the data ranks' -- over the *gradient group*, every rank of a stage.
Without sequence parallelism the gradient group is the data group.

`torch.distributed.new_group` must be called by *every* rank for *every* group in the same
order, even for groups a rank is not in, so gpc builds all of them (context.py) from `layout()`,
a pure function of the sizes that the tests check for many shapes without starting a process.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Optional


@dataclass
class Layout:
    """Every group of a job as lists of global ranks, in the order new_group must be called;
    gpc keeps each as gpc.<name>_group and gpc.<name>_ranks."""
    data: list[list[int]] = field(default_factory=list)       # same (pipeline, tensor) rank
    pipeline: list[list[int]] = field(default_factory=list)   # same (data, tensor) rank, in order
    tensor: list[list[int]] = field(default_factory=list)     # one stage of one replica
    tensor_row: list[list[int]] = field(default_factory=list)    # 2d: same row (splits hidden)
    tensor_col: list[list[int]] = field(default_factory=list)    # 2d: same column (splits batch)
    tensor_depth: list[list[int]] = field(default_factory=list)  # 2.5d: same row, col; each grid
    tensor_batch: list[list[int]] = field(default_factory=list)  # 2.5d: same col; each grid, row
    tensor_x: list[list[int]] = field(default_factory=list)   # 3d: same (y, z), every x
    tensor_y: list[list[int]] = field(default_factory=list)   # 3d: same (x, z), every y
    tensor_z: list[list[int]] = field(default_factory=list)   # 3d: same (x, y), every z
    tensor_xy: list[list[int]] = field(default_factory=list)  # 3d: same z, every (x, y)
    tensor_xz: list[list[int]] = field(default_factory=list)  # 3d: same y, every (x, z)
    model: list[list[int]] = field(default_factory=list)      # one whole model replica: P * T ranks
    gradient: list[list[int]] = field(default_factory=list)   # sequence: same parameters
    ep: list[list[int]] = field(default_factory=list)         # EP consecutive data ranks
    # for each G dividing EP, the data ranks with equal data_rank % G (hold the same experts)
    expert_data: dict[int, list[list[int]]] = field(default_factory=dict)


# the groups gpc builds from a Layout, in the order every rank creates them (EP's: context.py)
GROUPS = tuple(f.name for f in fields(Layout) if f.name not in ("ep", "expert_data"))


def coordinates(rank: int, P: int, T: int) -> tuple[int, int, int]:
    """(data_rank, pipeline_rank, tensor_rank) of a global rank."""
    data_rank, rest = divmod(rank, P * T)
    pipeline_rank, tensor_rank = divmod(rest, T)
    return data_rank, pipeline_rank, tensor_rank


def layout(world: int, P: int = 1, T: int = 1, mode: Optional[str] = None,
           ep: int = 1, depth: int = 1) -> Layout:
    """The groups of a world of `world` ranks with P stages, T tensor ranks (2.5d: `depth`
    grids) and expert parallelism EP (pure function; config_checks.check_world refuses a world
    that does not divide)."""
    D = world // (P * T)
    rank = lambda d, p, t: d * P * T + p * T + t  # noqa: E731 -- the formula, read as such
    out = Layout()
    out.data = [[rank(d, p, t) for d in range(D)] for p in range(P) for t in range(T)]
    out.pipeline = [[rank(d, p, t) for p in range(P)] for d in range(D) for t in range(T)]
    out.tensor = [[rank(d, p, t) for t in range(T)] for d in range(D) for p in range(P)]
    out.model = [[rank(d, p, t) for p in range(P) for t in range(T)] for d in range(D)]
    if mode == "sequence":  # every (data, sequence) rank of a stage; else the data group
        out.gradient = [[rank(d, p, t) for d in range(D) for t in range(T)] for p in range(P)]
    if mode in ("2d", "2.5d"):
        _grids(out, math.isqrt(T // depth), depth)
    if mode == "3d":
        _cube(out, round(T ** (1 / 3)))
    if ep > 1:
        out.ep, out.expert_data = ep_layout(out.data, ep)
    return out


def _grids(out: Layout, q: int, depth: int) -> None:
    """2d, 2.5d: each tensor group as `depth` q x q grids, their rows, columns and depth."""
    at = lambda k, r, c: k * q * q + r * q + c  # noqa: E731 -- grid k, row r, column c
    for group in out.tensor:
        out.tensor_row += [[group[at(k, r, c)] for c in range(q)] for k in range(depth)
                    for r in range(q)]
        out.tensor_col += [[group[at(k, r, c)] for r in range(q)] for k in range(depth)
                    for c in range(q)]
        if depth > 1:
            out.tensor_depth += [[group[at(k, r, c)] for k in range(depth)] for r in range(q)
                          for c in range(q)]
            out.tensor_batch += [[group[at(k, r, c)] for k in range(depth) for r in range(q)]
                          for c in range(q)]


def _cube(out: Layout, q: int) -> None:
    """3d: each tensor group as a q x q x q cube, its axes and planes."""
    at = lambda x, y, z: x * q * q + y * q + z  # noqa: E731 -- the cube's coordinates
    pairs = [(a, b) for a in range(q) for b in range(q)]
    for group in out.tensor:
        out.tensor_x += [[group[at(i, a, b)] for i in range(q)] for a, b in pairs]
        out.tensor_y += [[group[at(a, i, b)] for i in range(q)] for a, b in pairs]
        out.tensor_z += [[group[at(a, b, i)] for i in range(q)] for a, b in pairs]
        out.tensor_xy += [[group[at(a, b, z)] for a, b in pairs] for z in range(q)]
        out.tensor_xz += [[group[at(a, y, b)] for a, b in pairs] for y in range(q)]


def ep_layout(data: list[list[int]], ep: int) -> tuple[list[list[int]], dict]:
    """Expert parallelism inside each data group (ranks in data-rank order): EP groups are EP
    consecutive data ranks. A layer of E experts trades tokens with its *peers*, the G = min(E, EP)
    consecutive ranks that hold all E experts between them (moe/placement.py), so an expert is held
    by the data ranks with equal data_rank % G -- one group list per G dividing EP.
    `data` has one group per pipeline stage (and tensor rank), so under a pipeline every stage
    has its own expert groups: a stage's experts only ever meet the same stage's replicas.

        D = 4, EP = 2:  ep [0 1] [2 3];  G=2: [0 2] [1 3];  G=1: [0 1 2 3]"""
    eps = [ranks[i:i + ep] for ranks in data for i in range(0, len(ranks), ep)]
    peer_counts = [g for g in range(1, ep + 1) if ep % g == 0]
    return eps, {g: [ranks[i::g] for ranks in data for i in range(g)] for g in peer_counts}

