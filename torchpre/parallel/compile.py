"""torch.compile per transformer block: small graphs that compile once and are reused by every block."""

from torch import nn


def compile_blocks(blocks: nn.ModuleDict, tensor_parallel: bool = False, fullgraph: bool = True) -> None:
    """Compiles each block's forward in place (`Module.compile`), so module and parameter names stay
    as they are for checkpoints, tensor-parallel plans and pipeline splits.

    Under tensor parallelism each child of a block (norms, attention, feed-forward) is compiled on its
    own instead, with its DTensor input/output hooks inside its graph: a whole tensor-parallel block
    compiled as one graph fails in backward on torch 2.14 (a plain gradient reaches a DTensor
    redistribution), while graphs per child train correctly. The residual additions stay eager.

    `fullgraph=False` lets blocks with data-dependent shapes (Mixture-of-Experts token counts) compile
    in pieces around the graph breaks.
    """
    for block in blocks.values():
        modules = block.children() if tensor_parallel else (block,)
        for module in modules:
            module.compile(fullgraph=fullgraph)
