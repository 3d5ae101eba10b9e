"""The reusable parallelize API; see `torchpre.parallel.api`. The optimizer is `torchpre.optim.build_optimizer`."""

from torchpre.parallel.api import ParallelModel, ParallelPlan, logits_of, parallelize, pipeline_stages
from torchpre.parallel.pipeline import PipelinePlan

__all__ = ["ParallelModel", "ParallelPlan", "PipelinePlan", "logits_of", "parallelize", "pipeline_stages"]
