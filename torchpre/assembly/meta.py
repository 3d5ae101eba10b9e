"""The plain model on the meta device, in the dtype its parameters train in: built once, here, for training,
validation, generation and conversion, then parallelized and materialised shard by shard."""

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from torchpre.config.job_config import JobConfig
from torchpre.models.args import ModelArgs
from torchpre.models.registry import ModelSpec


def meta_model(config: JobConfig, spec: ModelSpec, args: ModelArgs, *, fp32: bool = False) -> nn.Module:
    """The whole plain model on the meta device, its parameters in training.mixed_precision_param; in fp32 with
    `fp32` (training with sharded parameters: FSDP's sharded fp32 parameters are the optimizer's masters, and its
    mixed precision policy casts them to the compute dtype)."""
    dtype = torch.float32 if fp32 else getattr(torch, config.training.mixed_precision_param)
    with torch.device("meta"), _default_dtype(dtype):
        return spec.build.model_cls(args)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Parameters created inside get `dtype`; buffers computed in an explicit dtype (RoPE) keep theirs."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
