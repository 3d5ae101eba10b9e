"""Loss-spike detection: a loss far above the recent ones, warned about (and counted) by the step guard."""

import math
import statistics
from collections import deque


class LossSpikeDetector:
    """Flags a loss more than `zscore` standard deviations above the mean of the previous `window` losses.

    It stays silent until the window is full: a mean and deviation over a handful of early, fast-falling
    losses would flag noise. Every finite loss enters the window, spikes included, so a lasting jump of
    the loss level is reported for about a window and then becomes the new normal.
    """

    def __init__(self, zscore: float, window: int) -> None:
        self.zscore = zscore
        self._recent: deque[float] = deque(maxlen=window)

    def check(self, loss: float) -> float | None:
        """The loss's z-score if it is a spike, else None; then remembers the loss."""
        spike = None
        if len(self._recent) == self._recent.maxlen:
            mean, std = statistics.fmean(self._recent), statistics.pstdev(self._recent)
            if std > 0 and (loss - mean) / std > self.zscore:
                spike = (loss - mean) / std
        if math.isfinite(loss):
            self._recent.append(loss)
        return spike
