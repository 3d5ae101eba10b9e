"""torch.compile per transformer block: small graphs that compile once and are reused by every block."""

from torch import nn


def compile_blocks(blocks: nn.ModuleDict) -> None:
    """Compiles each block's forward in place (`Module.compile`), so module and parameter names stay
    as they are for checkpoints, tensor-parallel plans and pipeline splits."""
    for block in blocks.values():
        block.compile(fullgraph=True)
