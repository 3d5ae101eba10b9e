"""The reusable parallelize API; see `torchpre.parallel.api`."""

from torchpre.parallel.api import (
    ParallelModel,
    ParallelPlan,
    build_optimizer,
    parallelize,
    pipeline_stages,
)
from torchpre.parallel.pipeline import PipelinePlan

__all__ = ["ParallelModel", "ParallelPlan", "PipelinePlan", "build_optimizer", "parallelize", "pipeline_stages"]
