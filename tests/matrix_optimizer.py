"""An optimizer whose update reads whole matrices, registered as a user registers one (from a module named by
`job.custom_import`), without a distributed implementation: torch's own Muon. The bad-input catalogue shows it
refused where a rank holds shards of a matrix."""

import torch

from torchpre.optim import OptimizerSpec, register_optimizer

register_optimizer("TorchMuon", OptimizerSpec(torch.optim.Muon, ("lr", "weight_decay"), elementwise=False))
