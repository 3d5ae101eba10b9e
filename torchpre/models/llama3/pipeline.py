"""How Llama 3 splits into pipeline stages: embedding first, norm and output last, layers in between."""

from collections.abc import Sequence

from torchpre.models.llama3.args import TransformerArgs
from torchpre.parallel.pipeline import split_layers


def llama3_stage_modules(args: TransformerArgs, num_stages: int, split_points: Sequence[str] = ()) -> list[list[str]]:
    """The module names each stage holds, e.g. [["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]]."""
    layers = [f"layers.{i}" for i in range(args.n_layers)]
    stages = split_layers(layers, num_stages, split_points)
    stages[0].insert(0, "tok_embeddings")
    stages[-1].extend(["norm", "output"])
    return stages


def llama3_tied_weights(args: TransformerArgs) -> tuple[str, str] | None:
    """The two copies of the tied embedding when the first and last stage hold one each."""
    return ("tok_embeddings.weight", "output.weight") if args.tie_word_embeddings else None
