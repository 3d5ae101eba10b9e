"""The host-sync counter (tests/host_syncs.py) sees each kind of call that blocks a GPU's host, once, with the line
that made it, and nothing else: the budget test (tests/integration/test_host_syncs.py) is only as good as it."""

import torch

from tests.host_syncs import HostSyncCounter

x = torch.tensor([1.0, 0.0, 2.0])
repeats = torch.tensor([1, 2, 3])
SYNCS = {
    "item": lambda: x[0].item(),
    "bool": lambda: bool(x[0]),
    "if": lambda: 1 if x[1] else 0,
    "int": lambda: int(x[0]),
    "float": lambda: float(x[0]),
    "tolist": lambda: x.tolist(),
    "numpy": lambda: x.numpy(),
    "cpu": lambda: x.cpu(),
    "to cpu": lambda: x.to("cpu"),
    "mask index": lambda: x[x > 0],
    "mask assign": lambda: x.clone().__setitem__(x > 0, torch.tensor([5.0, 6.0])),
    "where one-arg": lambda: torch.where(x > 0),
    "nonzero": lambda: x.nonzero(),
    "masked_select": lambda: x.masked_select(x > 0),
    "unique": lambda: torch.unique(x),
    "repeat_interleave": lambda: x.repeat_interleave(repeats),
    "equal": lambda: torch.equal(x, x),
    "tensor from host data on a device": lambda: torch.tensor([1.0, 2.0], device=x.device),
    "as_tensor from host data on a device": lambda: torch.as_tensor([1.0, 2.0], device=x.device),
}
FREE = {
    "arithmetic": lambda: (x * 2 + 1).sum(),
    "isfinite all": lambda: torch.isfinite(x).all(),
    "where three-arg": lambda: torch.where(x > 0, x, -x),
    "non-blocking to": lambda: x.to("cpu", non_blocking=True),
    "dtype to": lambda: x.to(torch.float64),
    "index by ints": lambda: x[torch.tensor([0, 2])],
    "mask fill by a scalar": lambda: x.clone().__setitem__(x > 1, 0.0),  # ATen's masked_fill_
    "repeat_interleave output_size": lambda: x.repeat_interleave(repeats, output_size=6),
    "repeat_interleave int": lambda: x.repeat_interleave(2),
    "tensor on the host": lambda: torch.tensor([1.0, 2.0]),
}


def test_counts_each_sync_once_with_its_line():
    for name, call in SYNCS.items():
        counter = HostSyncCounter()
        with counter.counting():
            call()
        assert len(counter.syncs) == 1, f"{name}: {[s.describe() for s in counter.syncs]}"
        assert __file__ in counter.syncs[0].site, f"{name}: {counter.syncs[0].describe()}"


def test_free_calls_and_paused_spans_count_nothing():
    counter = HostSyncCounter()
    with counter.counting():
        for call in FREE.values():
            call()
        with counter.pause():
            x.tolist(), x[0].item()
    assert counter.syncs == [], [s.describe() for s in counter.syncs]


def test_wrapped_functions_are_restored():
    def current():
        t = torch.Tensor
        return [t.tolist, t.cpu, t.to, t.numpy, torch.tensor, torch.as_tensor]

    before = current()
    with HostSyncCounter().counting():
        assert current() != before
    assert current() == before


def test_host_resident_tensors_are_not_counted():
    step = torch.tensor(3.0)
    counter = HostSyncCounter(host_resident=lambda: [step])
    with counter.counting():
        step.item(), step.tolist()
        x[0].item()
    assert [s.site.split(":")[0] for s in counter.syncs] == [__file__], [s.describe() for s in counter.syncs]
