"""Parallel degrees of a training job and the named process groups they imply.

:class:`ParallelDims` is the one place that says how the world's ranks split: ``dp × cp × pp``
ranks, plus ``virtual_stages`` model chunks per pipeline rank for interleaved schedules.  It
validates the product against the world size (printing every factor when it does not match)
and the layer count against the number of pipeline stages; both raise
:class:`~specrl.errors.LayoutError`.

Rank order (pp outermost, cp innermost, as torchtitan does, so the ranks of a context-parallel
ring are neighbours — the same host under a usual launcher)::

    rank = (pp_index · dp + dp_index) · cp + cp_index

:meth:`ParallelDims.build_groups` (collective: every rank calls it) creates one process group per
name and returns this rank's:

- ``"pp"``: the ranks of this rank's pipeline, in stage order (pipeline send/recv);
- ``"dp"``: the data-parallel replicas of this rank;
- ``"cp"``: this rank's context-parallel ring;
- ``"dp_cp"``: every rank holding the same parameters (gradient all-reduce).

Plain ``torch.distributed`` groups rather than a ``DeviceMesh``: the same gloo/NCCL groups, and
the rank lists stay visible (:meth:`ParallelDims.group_ranks`) for components that must create
their own groups collectively, such as the TapChannel's dedicated links.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch.distributed as dist

from specrl.errors import LayoutError

GroupName = Literal["pp", "dp", "cp", "dp_cp"]
GROUP_NAMES: tuple[GroupName, ...] = ("pp", "dp", "cp", "dp_cp")
# the coordinates that vary inside a group of each name
_VARYING: dict[str, tuple[str, ...]] = {
    "pp": ("pp",),
    "dp": ("dp",),
    "cp": ("cp",),
    "dp_cp": ("dp", "cp"),
}


@dataclass(frozen=True)
class Coords:
    """Where one rank sits in the ``pp × dp × cp`` grid."""

    pp: int
    dp: int
    cp: int


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of parallelism of a job; their product must be the world size."""

    world_size: int
    """number of ranks in the job"""
    dp: int = 1
    """data-parallel replicas, each a whole pipeline over its own microbatches"""
    cp: int = 1
    """context-parallel ranks sharing every packed sequence (zigzag ring attention)"""
    pp: int = 1
    """pipeline ranks"""
    virtual_stages: int = 1
    """model chunks per pipeline rank (> 1 only for interleaved schedules)"""

    def __post_init__(self) -> None:
        degrees = {
            "world_size": self.world_size,
            "dp": self.dp,
            "cp": self.cp,
            "pp": self.pp,
            "virtual_stages": self.virtual_stages,
        }
        bad = {k: v for k, v in degrees.items() if not isinstance(v, int) or v < 1}
        if bad:
            raise LayoutError(
                "parallel degrees must be positive integers, got "
                + ", ".join(f"{k}={v!r}" for k, v in bad.items())
            )
        product = self.dp * self.cp * self.pp
        if product != self.world_size:
            raise LayoutError(
                f"dp × cp × pp = {self.dp} × {self.cp} × {self.pp} = {product} does not match "
                f"the world size {self.world_size}",
                hint="choose degrees whose product is the number of launched ranks",
            )

    @property
    def num_stages(self) -> int:
        """Pipeline stages (model chunks) in one pipeline: pp × virtual_stages."""
        return self.pp * self.virtual_stages

    def check_layers(self, num_layers: int) -> None:
        """Every pipeline stage needs at least one decoder layer."""
        if num_layers < self.num_stages:
            raise LayoutError(
                f"{num_layers} decoder layers cannot fill pp × virtual_stages = {self.pp} × "
                f"{self.virtual_stages} = {self.num_stages} pipeline stages",
                hint="lower pp or virtual_stages",
            )

    # ------------------------------------------------------------------ rank arithmetic
    def rank(self, pp: int, dp: int, cp: int) -> int:
        """Global rank of grid position (pp, dp, cp)."""
        return (pp * self.dp + dp) * self.cp + cp

    def coords(self, rank: int) -> Coords:
        """Grid position of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of {self.world_size}")
        return Coords(
            pp=rank // (self.dp * self.cp), dp=(rank // self.cp) % self.dp, cp=rank % self.cp
        )

    def group_ranks(self, name: GroupName) -> list[list[int]]:
        """Rank lists of every group of a kind, each ascending (``"pp"``: stage order).

        A group holds the ranks that agree on every coordinate outside its name: ``"pp"`` has one
        pipeline per (dp, cp) position, ``"dp_cp"`` one group per pipeline stage.
        """
        if name not in _VARYING:
            raise ValueError(f"unknown group {name!r}; choose one of {GROUP_NAMES}")
        varying = _VARYING[name]
        groups: dict[tuple[int, ...], list[int]] = {}
        for r in range(self.world_size):
            c = self.coords(r)
            key = tuple(getattr(c, f) for f in ("pp", "dp", "cp") if f not in varying)
            groups.setdefault(key, []).append(r)
        return list(groups.values())

    def build_groups(self) -> ParallelGroups:
        """Create every named group (collective over the world) and return this rank's."""
        if dist.get_world_size() != self.world_size:
            raise LayoutError(
                f"ParallelDims is for {self.world_size} ranks but the process group has "
                f"{dist.get_world_size()}"
            )
        mine: dict[str, dist.ProcessGroup] = {}
        for name in GROUP_NAMES:
            group, _ = dist.new_subgroups_by_enumeration(self.group_ranks(name))
            mine[name] = group
        return ParallelGroups(self, dist.get_rank(), mine)


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's process groups by name (see :data:`GROUP_NAMES`)."""

    dims: ParallelDims
    rank: int
    groups: dict[str, dist.ProcessGroup]

    @property
    def coords(self) -> Coords:
        return self.dims.coords(self.rank)

    def __getitem__(self, name: GroupName) -> dist.ProcessGroup:
        return self.groups[name]

    def ranks(self, name: GroupName) -> list[int]:
        """Global ranks of this rank's group ``name``."""
        return next(r for r in self.dims.group_ranks(name) if self.rank in r)
