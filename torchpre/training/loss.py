"""The training loss: the mean token cross-entropy over the whole global batch, for any layout; and the inputs a
model's forward gets besides the tokens."""

import torch
import torch.nn.functional as F

from torchpre.parallel.api import ForwardOutput, logits_of
from torchpre.parallel.chunked_output import ChunkedProjection
from torchpre.parallel.forward_inputs import future_tokens
from torchpre.step_rules.batch import CurrentBatch


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed token cross-entropy, computed in fp32 whatever the logits' dtype."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")


class GlobalMeanLoss:
    """A microbatch's share of the global-batch mean token cross-entropy: its summed token losses divided by the
    global token count (the `batch`'s tokens per step), not the microbatch's. So the sum over microbatches, pipeline
    chunks and DP ranks is the exact global mean, for any layout. `compile` compiles the sum (not under loss parallel,
    whose vocab-sharded DTensor logits go through loss_parallel's dispatch).

    Under training.loss_chunk_size the model returns its final hidden states, not logits: `project_with` gives the
    last stage's output layer (`ChunkedProjection`, known once the model is built), which scores them a chunk of
    tokens at a time."""

    def __init__(self, batch: CurrentBatch, compile: bool = False):
        self.batch = batch
        self.cross_entropy_sum = torch.compile(cross_entropy_sum) if compile else cross_entropy_sum

    @property
    def tokens_per_step(self) -> int:
        return self.batch.sizes.tokens_per_step

    def project_with(self, projection: ChunkedProjection) -> None:
        self.cross_entropy_sum = projection.cross_entropy_sum

    def __call__(self, output: ForwardOutput, labels: torch.Tensor) -> torch.Tensor:
        return self.cross_entropy_sum(logits_of(output), labels) / self.tokens_per_step


class ForwardInputs:
    """What a model's forward gets besides the tokens: under training.document_mask, `document_ids`, each position's
    document in the packed rows. A new one starts at every BOS token (positions before a row's first BOS end a
    document begun in an earlier row). For a model that reads `tokens_ahead` tokens after each position
    (`ModelSpec.hooks.tokens_ahead`: multi-token prediction), `future_tokens` [batch, seq, tokens_ahead]."""

    def __init__(self, document_mask: bool, bos_id: int | None, tokens_ahead: int = 0):
        self.document_mask, self.bos_id, self.tokens_ahead = document_mask, bos_id, tokens_ahead

    def __call__(self, inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        kwargs = {"future_tokens": future_tokens(inputs, self.tokens_ahead)} if self.tokens_ahead else {}
        if self.document_mask:
            kwargs["document_ids"] = (inputs == self.bos_id).cumsum(dim=1)
        return kwargs
