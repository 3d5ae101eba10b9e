"""One rank's share of a model, built under a job's layout (its ZeRO-3 or tensor-parallel sharding) in
training.mixed_precision_param and without an optimizer, loaded from checkpoint.initial_load_path (a Hugging Face
folder) by the loader training uses (`torchpre.interchange.load.load_hf_weights`); each rank writes its load report
(bytes held and read, RSS before and at its peak while loading) to {dump_folder}/load_rank{R}.json.

For the memory tests: a whole training job would also hold fp32 masters and optimizer state, which a folder of
billions of parameters does not leave room for on one machine. Run like train.py (`torchrun ... tests/hf_load_memory.py
--section.key value ...`).
"""

import dataclasses
import json
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchpre.runtime.cli import run_entry_point  # noqa: E402


def main(argv: list[str]) -> None:
    from torchpre.assembly.meta import meta_model
    from torchpre.assembly.plans import parallel_plan
    from torchpre.config.job_config import JobConfig
    from torchpre.config.parser import parse_args
    from torchpre.interchange.load import load_hf_weights
    from torchpre.parallel.api import parallelize
    from torchpre.runtime.world import Runtime
    from torchpre.training.preflight import preflight

    config = parse_args(JobConfig, argv)
    runtime = Runtime.from_env()
    pre = preflight(config, runtime.world_size)
    device = runtime.device()
    runtime.join(device, config.comm.init_timeout_seconds)
    meshes = pre.dims.build_meshes(device.type, fsdp=pre.data_parallel.shards_parameters)
    spec, args = pre.model_spec, pre.model_args
    model = parallelize(
        meta_model(config, spec, args), meshes.mesh, parallel_plan(config, spec, args, pre.pipeline, pre.data_parallel),
        device=device, init_weights=spec.build.init_buffers, expert_mesh=meshes.expert_mesh, dp_mesh=meshes.fsdp_mesh,
        expert_dp_mesh=meshes.expert_fsdp_mesh,
    )  # fmt: skip
    targets = {name: tensor for part in model.parts for name, tensor in part.state_dict().items()}
    report = load_hf_weights(pre.weights.weights, targets)
    folder = Path(config.job.dump_folder)
    folder.mkdir(parents=True, exist_ok=True)
    summary = dataclasses.asdict(report) | {"bound": report.bound}
    (folder / f"load_rank{dist.get_rank()}.json").write_text(json.dumps(summary))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_entry_point(main, sys.argv[1:], prog="tests/hf_load_memory.py")
