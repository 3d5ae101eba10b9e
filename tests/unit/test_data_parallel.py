"""Bucketing of the data-parallel gradient all-reduce."""

import torch

from torchpre.distributed.collectives import _buckets


def test_buckets_keep_order_respect_size_and_split_on_dtype():
    tensors = [torch.zeros(10), torch.zeros(10), torch.zeros(30), torch.zeros(5, dtype=torch.bfloat16), torch.zeros(1)]
    buckets = list(_buckets(tensors, bucket_bytes=100))
    assert [[t.numel() for t in b] for b in buckets] == [[10, 10], [30], [5], [1]]
    assert [t for b in buckets for t in b] == tensors
