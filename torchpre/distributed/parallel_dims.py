"""The parallel layout: validated degrees and the one DeviceMesh that every collective goes through."""

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from torchpre.errors import ConfigError

MESH_DIM_NAMES = ("pp", "dp", "tp")
EXPERT_MESH_DIM_NAMES = ("pp", "edp", "ep", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of pipeline, data and tensor parallelism; their product is the world size.

    Expert parallelism (`ep`) is carved out of data parallelism: the dp ranks form dp/ep groups of ep
    ranks; each group splits the experts among its ranks and exchanges tokens within itself, while the
    dp/ep ranks that hold the same experts (an `edp` group) reduce those experts' gradients.
    """

    dp: int
    tp: int
    pp: int
    world_size: int
    ep: int = 1

    @classmethod
    def from_degrees(cls, dp: int, tp: int, pp: int, world_size: int, ep: int = 1) -> "ParallelDims":
        """Resolves dp = -1 to world_size / (tp x pp) and checks that the layout fits the world."""
        for key, value in (
            ("tensor_parallel_degree", tp),
            ("pipeline_parallel_degree", pp),
            ("expert_parallel_degree", ep),
        ):
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
        if dp % ep:
            raise ConfigError(
                f"parallelism.expert_parallel_degree = {ep} must divide the data-parallel degree {dp}: expert "
                "parallelism splits the experts over groups of data-parallel ranks. Use a divisor of "
                f"{dp} or launch more processes."
            )
        return cls(dp=dp, tp=tp, pp=pp, world_size=world_size, ep=ep)

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """One 3-D mesh (pp, dp, tp); tp is innermost so tensor-parallel peers are neighbours."""
        return init_device_mesh(device_type, (self.pp, self.dp, self.tp), mesh_dim_names=MESH_DIM_NAMES)

    def build_expert_mesh(self, device_type: str) -> DeviceMesh | None:
        """The same ranks as (pp, edp, ep, tp), dp split into edp x ep with ep innermost (dp rank = edp
        rank x ep + ep rank); None without expert parallelism."""
        if self.ep == 1:
            return None
        shape = (self.pp, self.dp // self.ep, self.ep, self.tp)
        return init_device_mesh(device_type, shape, mesh_dim_names=EXPERT_MESH_DIM_NAMES)
