"""The world a job runs in: the one torchrun launched, or, for a dry run, one rank of a world that exists only in
torch's fake process group."""

import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from torchpre.distributed.process_groups import init_distributed, select_device, world_size_from_env


@dataclass(frozen=True)
class Runtime:
    """Where this process runs the job: the world torchrun launched (`from_env`), or, for a dry run, one rank of
    a world that exists only in torch's fake process group (`fake`): no peers, collectives that move nothing,
    every tensor on the meta device. The trainer's code path is the same for both, so a dry run meets every
    check a real start-up meets, with the same message."""

    world_size: int
    fake_rank: int | None = None
    data: bool = True  # False: no data loader (a planner's fake ranks: the model and optimizer alone)

    @classmethod
    def from_env(cls) -> "Runtime":
        return cls(world_size_from_env())

    @property
    def fake(self) -> bool:
        return self.fake_rank is not None

    def device(self) -> torch.device:
        return torch.device("meta") if self.fake else select_device()

    def join(self, device: torch.device, timeout_s: float) -> None:
        """Joins the process group: the real one (`init_distributed`), or a fake world of `world_size`."""
        if not self.fake:
            init_distributed(device, timeout_s)
            return
        from torch.testing._internal.distributed.fake_pg import FakeStore

        hook = sys.excepthook  # torch wraps it with a rank prefix per group: one process joins many fake worlds
        dist.init_process_group("fake", store=FakeStore(), rank=self.fake_rank, world_size=self.world_size)
        sys.excepthook = hook
