"""The parallel layout: validated degrees and the DeviceMesh views that every collective goes through.

All views are cut from one 1-D world mesh (`DeviceMesh._unflatten`), so they share a root: FSDP2 needs that to
combine its data-parallel mesh with the tensor-parallel mesh of a parameter (`DeviceMesh._concatenate`).
"""

import dataclasses
from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from torchpre.distributed.elastic import world_sizes_hint
from torchpre.errors import ConfigError, resolve_step

MESH_DIM_NAMES = ("pp", "dp", "tp")
CONTEXT_MESH_DIM_NAMES = ("pp", "dp", "cp", "tp")
DENSE_MESH_DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "tp")
EXPERT_MESH_DIM_NAMES = ("pp", "edp", "ep", "tp")
EXPERT_DENSE_MESH_DIM_NAMES = ("pp", "dp_replicate", "edp_shard", "ep", "tp")


@dataclass(frozen=True)
class Meshes:
    """The views of one job's ranks. Rank order is row-major in all of them, so a rank's dp coordinate is
    dp_replicate rank x dp_shard + dp_shard rank in every view.

    `mesh` (pp, dp, tp): data order, validation and ZeRO 0-2. `dense_mesh` (pp, dp_replicate, dp_shard, tp):
    ZeRO-3 (FSDP2 shards over dp_shard, HSDP replicates over dp_replicate); None below stage 3. `expert_mesh`
    (pp, edp, ep, tp): experts under expert parallelism; None without it. `expert_dense_mesh` (pp, dp_replicate,
    edp_shard, ep, tp): ZeRO-3 of expert-parallel experts, sharded over the edp_shard = dp_shard / ep ranks that
    hold the same experts within a replica group.

    Under context parallelism (cp > 1) the "dp" dimension of every view spans dp x cp ranks (cp innermost) and
    dp_shard spans dp_shard x cp: the cp ranks of a sequence reduce its gradients together and, under ZeRO, share
    the sharding, as torchtitan shards over dp_shard x cp. `context_mesh` (pp, dp, cp, tp) tells them apart: its
    "dp" is the data coordinate (which sequences), its "cp" the part of each sequence; None without cp.
    """

    mesh: DeviceMesh
    dense_mesh: DeviceMesh | None = None
    expert_mesh: DeviceMesh | None = None
    expert_dense_mesh: DeviceMesh | None = None
    context_mesh: DeviceMesh | None = None

    def all(self) -> list[DeviceMesh]:
        views = (self.mesh, self.dense_mesh, self.expert_mesh, self.expert_dense_mesh, self.context_mesh)
        return [m for m in views if m is not None]

    def data_rank(self) -> tuple[int, int]:
        """(this rank's data-parallel coordinate, the data-parallel degree): which slice of the global batch it
        reads. Without cp the "dp" dimension of `mesh`; with it, `context_mesh`'s."""
        view = self.context_mesh if self.context_mesh is not None else self.mesh
        return view["dp"].get_local_rank(), view["dp"].size()

    @property
    def fsdp_mesh(self) -> DeviceMesh | None:
        """The mesh FSDP2 shards over: 1-D (dp_shard), or 2-D (dp_replicate, dp_shard) for HSDP."""
        return _fsdp_view(self.dense_mesh, "dp_shard")

    @property
    def expert_fsdp_mesh(self) -> DeviceMesh | None:
        """The mesh FSDP2 shards expert-parallel experts over: (edp_shard) or (dp_replicate, edp_shard)."""
        return _fsdp_view(self.expert_dense_mesh, "edp_shard")


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of pipeline, data, context and tensor parallelism; their product is the world size.

    Context parallelism (`cp`) splits each sequence over cp ranks that read the same sequences (see
    `torchpre.parallel.context_parallel`); for gradients and parameter sharding they count as data-parallel ranks.

    Expert parallelism (`ep`) is carved out of data parallelism: the dp ranks form dp/ep groups of ep
    ranks; each group splits the experts among its ranks and exchanges tokens within itself, while the
    dp/ep ranks that hold the same experts (an `edp` group) reduce those experts' gradients.
    """

    dp: int
    tp: int
    pp: int
    world_size: int
    ep: int = 1
    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1

    def __post_init__(self) -> None:
        if self.dp_shard == -1:  # frozen: set the resolved value once, as from_degrees would
            object.__setattr__(self, "dp_shard", self.dp // self.dp_replicate)

    @classmethod
    @resolve_step
    def from_degrees(
        cls,
        dp: int,
        tp: int,
        pp: int,
        world_size: int,
        ep: int = 1,
        dp_replicate: int = 1,
        dp_shard: int = -1,
        cp: int = 1,
    ) -> "ParallelDims":
        """Resolves dp = -1 to world_size / (tp x pp x cp) and dp_shard = -1 to dp / dp_replicate, and checks that
        the layout fits the world."""
        for key, value in (
            ("tensor_parallel_degree", tp),
            ("pipeline_parallel_degree", pp),
            ("expert_parallel_degree", ep),
            ("context_parallel_degree", cp),
        ):
            if value < 1:
                raise ConfigError(f"parallelism.{key} = {value}: it must be at least 1.")
        model_ranks = tp * pp * cp  # the ranks of one model replica
        if dp == -1:
            if world_size % model_ranks:
                named = "tensor_parallel_degree x pipeline_parallel_degree" + (
                    " x context_parallel_degree" if cp > 1 else ""
                )
                degrees = " x ".join(str(d) for d in ((tp, pp, cp) if cp > 1 else (tp, pp)))
                raise ConfigError(
                    f"The world size {world_size} is not divisible by {named} = {degrees}. Launch a multiple of "
                    f"{model_ranks} processes or change the parallelism.* degrees. "
                    f"{world_sizes_hint(tp, pp, ep, cp=cp)}"
                )
            dp = world_size // model_ranks
        elif dp < 1:
            raise ConfigError(f"parallelism.data_parallel_degree = {dp}: use -1 (all remaining processes) or >= 1.")
        if dp * model_ranks != world_size:
            cp_text = f" x cp {cp}" if cp > 1 else ""
            raise ConfigError(
                f"The layout dp x tp x pp{' x cp' if cp > 1 else ''} = {dp} x {tp} x {pp}{cp_text} = "
                f"{dp * model_ranks} does not match the {world_size} launched processes. Set "
                f"parallelism.data_parallel_degree = -1, or launch --nproc_per_node={dp * model_ranks}."
            )
        # Experts are split over the ranks that reduce the same gradients: dp x cp (a token's expert does not
        # depend on which sequence chunk holds it).
        if (dp * cp) % ep:
            raise ConfigError(
                f"parallelism.expert_parallel_degree = {ep} must divide the data-parallel degree {dp * cp}"
                f"{f' (dp {dp} x cp {cp})' if cp > 1 else ''}: expert parallelism splits the experts over groups "
                f"of data-parallel ranks. Use a divisor of {dp * cp} or launch more processes. "
                f"{world_sizes_hint(tp, pp, ep, cp=cp)}"
            )
        dp_replicate, dp_shard = _resolve_hsdp(dp, dp_replicate, dp_shard)
        if (dp_shard * cp) % ep:
            raise ConfigError(
                f"parallelism.expert_parallel_degree = {ep} must divide data_parallel_shard_degree = {dp_shard}: under "
                "HSDP each replica group splits the experts over its own shard ranks. Use a divisor of "
                f"{dp_shard}, or a smaller data_parallel_replicate_degree."
            )
        return cls(
            dp=dp, tp=tp, pp=pp, world_size=world_size, ep=ep, dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp
        )

    def build_meshes(self, device_type: str, *, fsdp: bool = False) -> Meshes:
        """The job's mesh views from one world mesh; `dense_mesh` only with `fsdp` (ZeRO-3)."""
        world = init_device_mesh(device_type, (self.world_size,), mesh_dim_names=("world",))
        dp, dp_shard = self.dp * self.cp, self.dp_shard * self.cp  # cp ranks reduce and shard like dp ranks
        mesh = world._unflatten(0, (self.pp, dp, self.tp), MESH_DIM_NAMES)
        meshes = Meshes(mesh=mesh)
        if self.cp > 1:
            context_shape = (self.pp, self.dp, self.cp, self.tp)
            meshes = dataclasses.replace(
                meshes, context_mesh=world._unflatten(0, context_shape, CONTEXT_MESH_DIM_NAMES)
            )
        if fsdp:
            dense_shape = (self.pp, self.dp_replicate, dp_shard, self.tp)
            meshes = dataclasses.replace(meshes, dense_mesh=world._unflatten(0, dense_shape, DENSE_MESH_DIM_NAMES))
        if self.ep > 1:
            expert_shape = (self.pp, dp // self.ep, self.ep, self.tp)
            meshes = dataclasses.replace(meshes, expert_mesh=world._unflatten(0, expert_shape, EXPERT_MESH_DIM_NAMES))
        if fsdp and self.ep > 1:
            shape = (self.pp, self.dp_replicate, dp_shard // self.ep, self.ep, self.tp)
            meshes = dataclasses.replace(
                meshes, expert_dense_mesh=world._unflatten(0, shape, EXPERT_DENSE_MESH_DIM_NAMES)
            )
        return meshes

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """One 3-D mesh (pp, dp, tp); tp is innermost so tensor-parallel peers are neighbours."""
        return self.build_meshes(device_type).mesh


def _resolve_hsdp(dp: int, replicate: int, shard: int) -> tuple[int, int]:
    """(dp_replicate, dp_shard) with shard = -1 resolved; their product must be the data-parallel degree."""
    if replicate < 1:
        raise ConfigError(f"parallelism.data_parallel_replicate_degree = {replicate}: it must be at least 1.")
    if shard == -1:
        if dp % replicate:
            raise ConfigError(
                f"parallelism.data_parallel_replicate_degree = {replicate} must divide the data-parallel degree "
                f"{dp}: each of the {replicate} replica groups shards the model over dp / {replicate} ranks. Use a "
                f"divisor of {dp}."
            )
        return replicate, dp // replicate
    if replicate * shard != dp:
        raise ConfigError(
            f"parallelism.data_parallel_replicate_degree x data_parallel_shard_degree = {replicate} x {shard} = "
            f"{replicate * shard} must equal the data-parallel degree {dp}. Set data_parallel_shard_degree = -1 "
            f"(= {dp} / replicate degree), or change data_parallel_degree."
        )
    return replicate, shard


def _fsdp_view(mesh: DeviceMesh | None, shard_dim: str) -> DeviceMesh | None:
    """`mesh`'s `shard_dim`, with dp_replicate in front when HSDP replicates over it."""
    if mesh is None:
        return None
    if mesh["dp_replicate"].size() > 1:
        return mesh["dp_replicate", shard_dim]
    return mesh[shard_dim]
