"""Data parallel with sharded layers: what the other ranks of rank 0's host do while it saves.

Rank 0 writes every checkpoint and final/, reading each unit's state where it lives. A sharded
layer (placement "shard") another local rank keeps on its GPU reaches it piece by piece: rank 0's
reads of that layer's StreamedTensors (state_tier.OtherRankGpu) pull from the owner, which answers
in serve() until rank 0 ends the save (DataParallel.pull / serve / end_serving). ranks.Ranks.on_main
runs the two sides around the save: `serve` on the owners, `end` on rank 0 once it is done.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..distributed import DataParallel
from .host_store import HostUnit
from .state_tier import SHARD_FIELDS


@dataclass
class SaveService:
    dp: DataParallel
    units: list[HostUnit]
    serving: frozenset[int]        # the local ranks of host 0 that own sharded layers (rank 0 excluded)

    @classmethod
    def for_engine(cls, dp: DataParallel | None, units: list[HostUnit], owners: list[int] | None,
                   sharded: list[int]) -> SaveService | None:
        """The service of an engine whose host shards layers over its GPUs; None where no save needs one."""
        if dp is None or not sharded:
            return None
        return cls(dp, units, frozenset(owners[i] for i in sharded) - {0})

    def serve(self) -> None:
        """A rank other than 0: answer rank 0's reads of this rank's sharded layers until it is done."""
        if self.dp.cfg.host == 0 and self.dp.cfg.local_rank in self.serving:
            self.dp.serve(self._read)

    def end(self) -> None:
        """Rank 0, its save done (or failed): the serving ranks return."""
        self.dp.end_serving(self.serving)

    def _read(self, unit_index: int, field: int, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of one of this rank's sharded layers' tensors (SHARD_FIELDS), [hi - lo]."""
        unit = self.units[unit_index]
        if not (unit.owned and unit.on_device):
            raise RuntimeError(f"{unit.spec.name} is not a sharded layer of this rank")
        name = SHARD_FIELDS[field]
        t = unit.master if name == "master" else unit.state_tensors()[name]
        return t.reshape(-1)[lo:hi]
