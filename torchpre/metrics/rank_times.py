"""What the ranks' times per step say together: the pipeline bubble, and the straggler that keeps the others
waiting.

A slow rank (a throttled GPU, a noisy neighbour, a GC pause) does not show in its own step time: every rank's
step ends at the same collective, so all step times equal the slowest rank's. What differs is where the time
went: the slow rank computes, the others wait inside collectives. So each rank's busy time is its step time
less its time in collectives (`CommTimer`'s total), and the straggler is the rank with the most of it.
"""

import logging
import statistics

logger = logging.getLogger("torchpre")


def pipeline_bubble_metrics(busy: list[float], windows: list[float], theory: float) -> dict[str, float]:
    """`pipeline/bubble` (the mean idle fraction over the pipeline ranks), `pipeline/bubble_max` (the idlest rank's)
    and `pipeline/bubble_theory`, from each pp rank's compute seconds (`busy`) and schedule-step seconds
    (`windows`) per step, as bench/pipeline_bubble.py measures them: idle = 1 - busy / window, against the
    longest rank's window, which spans the whole schedule step (a rank that finishes early idles until it ends)."""
    window = max(windows)
    idle = [1 - b / window for b in busy] if window > 0 else [0.0 for _ in busy]
    return {
        "pipeline/bubble": sum(idle) / len(idle),
        "pipeline/bubble_max": max(idle),
        "pipeline/bubble_theory": theory,
    }


def straggler_metrics(busy_per_rank: list[float]) -> dict[str, float]:
    """`straggler/slowest_rank` (the rank with the most busy time) and `straggler/spread`, (max - median) /
    median of the ranks' busy times: 0 when all are equal, 0.5 when the slowest is busy 1.5 times the median."""
    slowest = max(range(len(busy_per_rank)), key=busy_per_rank.__getitem__)
    median = statistics.median(busy_per_rank)
    spread = (busy_per_rank[slowest] - median) / median if median > 0 else 0.0
    return {"straggler/slowest_rank": slowest, "straggler/spread": spread}


class StragglerWatch:
    """Warns when the spread stays above `threshold` for `window` log intervals in a row, naming the rank and
    its host; then counts a new run of `window` intervals before warning again, so a persistent straggler is
    named every `window` intervals rather than at every log step."""

    def __init__(self, threshold: float, window: int, hosts: list[str]) -> None:
        self.threshold, self.window, self.hosts = threshold, window, hosts
        self._intervals_above = 0

    def observe(self, busy_per_rank: list[float], step: int) -> dict[str, float]:
        """The interval's straggler metrics; logs the warning when it is due."""
        metrics = straggler_metrics(busy_per_rank)
        spread, rank = metrics["straggler/spread"], int(metrics["straggler/slowest_rank"])
        self._intervals_above = self._intervals_above + 1 if spread > self.threshold else 0
        if self._intervals_above == self.window:
            self._intervals_above = 0
            median = statistics.median(busy_per_rank)
            logger.warning(
                "step %d: straggler: rank %d on host %s was busy %.3f s per step against a median of %.3f s over "
                "the ranks (spread %.2f, above metrics.straggler_threshold = %.2f for %d log intervals in a row); "
                "the other ranks wait for it in every collective",
                step, rank, self.hosts[rank], busy_per_rank[rank], median, spread, self.threshold, self.window,
            )
        return metrics
