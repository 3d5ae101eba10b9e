"""The metrics record of a training job: what the steps since the last record took (step times and their tail,
phases, time in each mesh dimension's collectives, data waits, saves), throughput and MFU, per-rank maxima of
memory and state, the straggler and the pipeline bubble from every rank's busy time, and whatever the other
components add (loss, health counters, data shares, router statistics). Every rank measures and takes part in the
gathers; rank 0 writes (`MetricsLogger`).

A record's own cost (reading the timers, gathering, writing; not validation) is outside every step's time and goes
into the next record as `time/metrics_s`.
"""

import contextlib
import logging
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import astuple, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from torchpre.config.job_config import Metrics
from torchpre.distributed.comm_timer import CommTimer
from torchpre.metrics.flops import peak_flops
from torchpre.metrics.logger import MetricsLogger
from torchpre.metrics.peak_memory import max_memory_bytes
from torchpre.metrics.rank_times import StragglerWatch, pipeline_bubble_metrics
from torchpre.metrics.timer import PhaseTimer, StepTimes, tail
from torchpre.step_rules.batch import CurrentBatch

logger = logging.getLogger("torchpre")


@dataclass(frozen=True)
class PipelineTiming:
    """What the pipeline bubble is measured against: the global ranks of rank 0's pipeline (its pp group), the
    schedule's theoretical bubble, and this rank's compute seconds in its stages since the last call (`busy`)."""

    ranks: list[int]
    theory: float
    busy: Callable[[], float]


@dataclass(frozen=True)
class RankTimes:
    """One rank's seconds per step over a log interval, gathered from every rank at log steps."""

    busy: float  # step time less time inside collectives: what a straggler has more of
    pipeline_busy: float  # compute of this rank's pipeline stages (0 without a pipeline)
    pipeline_window: float  # the forward-backward phase, the schedule step the bubble is a fraction of


@dataclass
class _Interval:
    """What the steps since the last metrics record add up."""

    steps: int = 0
    tokens: int = 0  # trained on (a global-batch ramp or a data stage changes them from step to step)
    samples: int = 0
    data_s: float = 0.0  # waiting for batches
    checkpoint_s: float = 0.0  # saves (they happen between steps, so no step time holds them)


class TrainingMetrics:
    """Times the steps and writes a record every `settings.log_freq` steps (see the module docstring).

    `sink` is rank 0's logger (None elsewhere); the step's `batch` and `flops_per_token(seq_len)` give throughput and
    MFU; `meshes` are the views whose collectives `settings.time_collectives` times; `pipeline`
    the bubble's reference (None without pipeline parallelism)."""

    def __init__(
        self,
        settings: Metrics,
        device: torch.device,
        sink: MetricsLogger | None,
        *,
        batch: CurrentBatch,
        flops_per_token: Callable[[int], int],
        meshes: list[DeviceMesh],
        pipeline: PipelineTiming | None = None,
        linear: str = "none",
    ):
        self.settings, self.device, self.sink = settings, device, sink
        self.batch, self.flops_per_token, self.pipeline = batch, flops_per_token, pipeline
        self.linear = linear  # quantize.linear: which datasheet peak MFU divides by
        self.world_size = dist.get_world_size()
        self.phases = PhaseTimer(device)
        self.step_times = StepTimes(device)
        self.times_collectives = settings.time_collectives and self.world_size > 1
        self.comm = CommTimer(device, meshes if self.times_collectives else [])
        self.peak, self.peak_name = 0.0, ""
        self.stragglers: StragglerWatch | None = None
        self._interval = _Interval()
        self._cost_s = 0.0  # what the last record cost to gather and write

    def phase(self, name: str) -> contextlib.AbstractContextManager:
        """Times a named phase of the step (`time/{name}_s`)."""
        return self.phases.phase(name)

    @contextlib.contextmanager
    def measuring(self) -> Iterator["TrainingMetrics"]:
        """While training: the peak FLOP/s, every rank's host name for the straggler warning, the collective
        timers installed; the first interval starts."""
        self.peak, self.peak_name = self._peak_flops()
        self.stragglers = StragglerWatch(self.settings.straggler_threshold, self.settings.straggler_window, _hosts())
        self.step_times.start()
        with self.comm.installed() if self.times_collectives else contextlib.nullcontext():
            yield self

    def paused(self) -> contextlib.AbstractContextManager:
        """Collectives inside are not timed (saves, validation, the record itself: not part of a step)."""
        return self.comm.paused()

    def data_wait(self, seconds: float) -> None:
        self._interval.data_s += seconds

    def checkpoint_wait(self, seconds: float) -> None:
        self._interval.checkpoint_s += seconds

    def step_done(self) -> None:
        self.step_times.step()
        self._interval.steps += 1
        self._interval.tokens += self.batch.sizes.tokens_per_step
        self._interval.samples += self.batch.sizes.global_batch_size

    def restart_interval(self) -> None:
        """The next interval's first step starts now (after a record and whatever followed it)."""
        self.step_times.start()

    def record(
        self,
        step: int,
        values: dict[str, Any],
        maxima: dict[str, int],
        extra: Callable[[], dict[str, Any]],
        evaluate: Callable[[], dict[str, float]] | None = None,
    ) -> None:
        """Reads the interval's timers, runs `evaluate` (the evaluations due: `val_loss`, `eval/<task>/acc` ...) if
        given, and writes the record of `step`:
        `values` (loss, lr, grad_norm: global already), the maximum over ranks of each of `maxima`, the timings, and
        `extra()` (collectives allowed: every rank calls it). A tensor in `values` is read on rank 0 only."""
        start = time.perf_counter()
        interval, self._interval = self._interval, _Interval()
        steps = interval.steps
        durations = self.step_times.durations()
        step_time = sum(durations) / steps
        phases = self.phases.averages(steps)
        comm_seconds = {kind: total / steps for kind, total in self.comm.totals().items()}
        timings = {f"time/{name}_s": v for name, v in phases.items()} | tail(durations)
        timings |= {f"time/comm_{kind}_s": comm_seconds[kind] for kind in self.comm.kinds_in_use}
        if interval.checkpoint_s:
            timings["time/checkpoint_s"] = interval.checkpoint_s
        if self._cost_s:
            timings["time/metrics_s"] = self._cost_s
        rank_times = RankTimes(
            busy=step_time - comm_seconds["total"],
            pipeline_busy=self.pipeline.busy() / steps if self.pipeline is not None else 0.0,
            pipeline_window=phases["forward_backward"],
        )
        with self.paused():
            self._cost_s = time.perf_counter() - start
            evaluated = evaluate() if evaluate is not None else {}
            start = time.perf_counter()
            per_step = (interval.tokens / steps, interval.samples / steps)
            self._write(
                step, step_time, interval.data_s / steps, timings, rank_times, values, maxima, extra, evaluated,
                per_step,
            )
            self._cost_s += time.perf_counter() - start

    def _write(
        self,
        step: int,
        step_time: float,
        data_time: float,
        timings: dict[str, float],
        rank_times: RankTimes,
        values: dict[str, Any],
        maxima: dict[str, int],
        extra: Callable[[], dict[str, Any]],
        evaluated: dict[str, float],
        per_step: tuple[float, float],
    ) -> None:
        """Gathers the per-rank maxima and times; rank 0 writes the record. `per_step`: the interval's mean tokens and
        samples per step."""
        reduced, every_rank = self._gather([max_memory_bytes(self.device), *maxima.values()], astuple(rank_times))
        more = extra()
        if self.sink is None:
            return
        more |= self._rank_time_metrics(every_rank, step)
        tokens_per_sec = per_step[0] / step_time
        mfu = self._mfu(self.flops_per_token(self.batch.sizes.seq_len) * tokens_per_sec / self.world_size)
        self.sink.log(
            {
                "step": step,
                **{key: value.item() if isinstance(value, torch.Tensor) else value for key, value in values.items()},
                "tokens_per_sec": tokens_per_sec,
                "tokens_per_sec_per_device": tokens_per_sec / self.world_size,
                "samples_per_sec": per_step[1] / step_time,
                "global_batch_size": self.batch.sizes.global_batch_size,
                "mfu": mfu,
                "mfu_peak": self.peak_name,
                "step_time_s": step_time,
                "data_time_s": data_time,
                "max_memory_bytes": int(reduced[0]),
                **{key: int(value) for key, value in zip(maxima, reduced[1:])},
                **timings,
                **more,
                **evaluated,
            }
        )

    def _gather(self, maxima: list[float], rank_times: tuple[float, ...]) -> tuple[list[float], list[list[float]]]:
        """The maximum over ranks of each of `maxima`, and every rank's `rank_times` by rank (one process: its own,
        with no collective)."""
        if self.world_size == 1:
            return list(maxima), [list(rank_times)]
        reduced = torch.tensor(maxima, dtype=torch.float64, device=self.device)
        dist.all_reduce(reduced, op=dist.ReduceOp.MAX)
        mine = torch.tensor(rank_times, dtype=torch.float64, device=self.device)
        every_rank = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(every_rank, mine)
        return reduced.tolist(), torch.stack(every_rank).tolist()

    def _rank_time_metrics(self, every_rank: list[list[float]], step: int) -> dict[str, float]:
        """The straggler metrics over all ranks (when there are several) and the pipeline bubble of rank 0's
        pipeline (under pipeline parallelism), from every rank's `RankTimes`."""
        metrics = {}
        if len(every_rank) > 1 and self.settings.time_collectives:
            metrics |= self.stragglers.observe([busy for busy, _, _ in every_rank], step)
        if self.pipeline is not None:
            metrics |= pipeline_bubble_metrics(
                busy=[every_rank[rank][1] for rank in self.pipeline.ranks],
                windows=[every_rank[rank][2] for rank in self.pipeline.ranks],
                theory=self.pipeline.theory,
            )
        return metrics

    def _peak_flops(self) -> tuple[float, str]:
        """One device's peak FLOP/s and its name: metrics.peak_flops, a GPU's datasheet value (FP8's under
        quantize.linear), or a matmul measured on each rank; the best rank's measurement counts (a rank that
        measured while its core was busy reads low)."""
        measured, name = peak_flops(self.device, self.settings.peak_flops, self.linear)
        peak = torch.tensor(measured, dtype=torch.float64, device=self.device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        logger.info("MFU is computed against the %s peak: %.4g FLOP/s per device", name, float(peak))
        return float(peak), name

    def _mfu(self, achieved_flops: float) -> float:
        """Achieved / peak FLOP/s per device. A measured peak is an estimate: if training itself runs faster,
        that rate is the better bound, so it becomes the peak (said once) and MFU never exceeds 100%."""
        if achieved_flops > self.peak and self.settings.peak_flops <= 0:
            logger.info(
                "training reached %.3g FLOP/s per device, above the measured matmul peak of %.3g (the machine was "
                "busier while it was measured): MFU is computed against %.3g from now on; set metrics.peak_flops "
                "to fix the peak",
                achieved_flops, self.peak, achieved_flops,
            )
            self.peak = achieved_flops
        return achieved_flops / self.peak

    def close(self) -> None:
        if self.sink is not None:
            self.sink.close()


def _hosts() -> list[str]:
    """Every rank's host name, by rank, for the straggler warning."""
    hosts = [""] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    return hosts
