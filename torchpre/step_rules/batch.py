"""A step's batch as laid out over data-parallel ranks and accumulation steps (`BatchSizes`), and the one object
that says which batch the step running now has (`CurrentBatch`)."""

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchSizes:
    """`global_batch_size` sequences of `seq_len` labelled tokens per optimizer step, as `accumulation_steps`
    microbatches of `local_batch_size` on each data-parallel rank."""

    global_batch_size: int
    accumulation_steps: int
    local_batch_size: int
    seq_len: int

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_len


class CurrentBatch:
    """The batch sizes of the step running now (or last run). The job publishes each step's
    (`TrainingJob.begin_step`); every component whose numbers follow the batch (the loss's divisor, throughput, the
    data loader's microbatches, the step guard's sample range, the progress a checkpoint records) is given this one
    object and reads it when it needs it, so a global-batch ramp or a data stage at another seq_len reaches them all
    at once and none is set from outside."""

    def __init__(self, sizes: BatchSizes):
        self.sizes = sizes
