"""The parallel layout: validated degrees and the one DeviceMesh that every collective goes through."""

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from torchpre.errors import ConfigError

MESH_DIM_NAMES = ("pp", "dp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of pipeline, data and tensor parallelism; their product is the world size."""

    dp: int
    tp: int
    pp: int
    world_size: int

    @classmethod
    def from_degrees(cls, dp: int, tp: int, pp: int, world_size: int) -> "ParallelDims":
        """Resolves dp = -1 to world_size / (tp x pp) and checks that the layout fits the world."""
        for key, value in (("tensor_parallel_degree", tp), ("pipeline_parallel_degree", pp)):
            if value < 1:
                raise ConfigError(f"parallelism.{key} = {value}: it must be at least 1.")
        if dp == -1:
            if world_size % (tp * pp):
                raise ConfigError(
                    f"The world size {world_size} is not divisible by tensor_parallel_degree x "
                    f"pipeline_parallel_degree = {tp} x {pp}. Launch a multiple of {tp * pp} processes "
                    "or change the parallelism.* degrees."
                )
            dp = world_size // (tp * pp)
        elif dp < 1:
            raise ConfigError(f"parallelism.data_parallel_degree = {dp}: use -1 (all remaining processes) or >= 1.")
        if dp * tp * pp != world_size:
            raise ConfigError(
                f"The layout dp x tp x pp = {dp} x {tp} x {pp} = {dp * tp * pp} does not match the {world_size} "
                "launched processes. Set parallelism.data_parallel_degree = -1, or launch "
                f"--nproc_per_node={dp * tp * pp}."
            )
        return cls(dp=dp, tp=tp, pp=pp, world_size=world_size)

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """One 3-D mesh (pp, dp, tp); tp is innermost so tensor-parallel peers are neighbours."""
        return init_device_mesh(device_type, (self.pp, self.dp, self.tp), mesh_dim_names=MESH_DIM_NAMES)
