"""The simulated job's randomness, seeded: per-rank compute noise, collective jitter, drift.

Compute time of rank i at a step is ``base x drift(t) x bias_i x (1 + cv x z)``
with z standard normal (clamped so a factor never drops below 0.5): the per-step
noise has the scenario's CV, ``bias_i`` is a small fixed per-rank speed
difference (real GPUs of one model differ by a fraction of a percent), and
the drift moves every rank together (data, thermals of the hall), so it never
makes one rank look slower than the others. The all-reduce's transfer time
gets its own jitter and rare spikes (a congested fabric for one step).
"""

from __future__ import annotations

import math
import random

from clusterwatch.sim.scenario import NoiseSettings

# No factor goes below this: a normal draw 25 sigma out must not make a negative time.
MIN_FACTOR = 0.5


class NoiseModel:
    """Draws the noise of one job, reproducibly for a given seed.

    Args:
        settings: the scenario's noise settings.
        ranks: world size.
        seed: seeds every draw.
    """

    def __init__(self, settings: NoiseSettings, ranks: int, seed: int) -> None:
        self.settings = settings
        self._rng = random.Random(seed)  # noqa: S311 - simulation noise, not security
        gauss = self._rng.gauss
        self.rank_bias = [
            max(MIN_FACTOR, 1.0 + settings.rank_bias_cv * gauss(0.0, 1.0)) for _ in range(ranks)
        ]
        self._drift_phase_rad = self._rng.uniform(0.0, 2 * math.pi)

    def drift(self, elapsed_s: float) -> float:
        """The common compute-time factor ``elapsed_s`` into the run (slow, about 1)."""
        s = self.settings
        return 1.0 + s.drift_amplitude_ratio * math.sin(
            2 * math.pi * elapsed_s / s.drift_period_s + self._drift_phase_rad
        )

    def compute_s(self, base_s: float) -> list[float]:
        """One step's compute time of every rank, before faults."""
        gauss = self._rng.gauss
        cv = self.settings.compute_cv
        return [base_s * bias * max(MIN_FACTOR, 1.0 + cv * gauss(0.0, 1.0)) for bias in self.rank_bias]

    def transfer_factor(self) -> float:
        """One step's all-reduce transfer time factor (jitter, sometimes a spike)."""
        s = self.settings
        factor = max(MIN_FACTOR, 1.0 + s.collective_cv * self._rng.gauss(0.0, 1.0))
        if s.collective_spike_probability and self._rng.random() < s.collective_spike_probability:
            factor *= s.collective_spike_ratio
        return factor

    def finish_jitter_s(self, ranks: int) -> list[float]:
        """How much later than the first each rank leaves the collective (exponential, seconds)."""
        mean_s = self.settings.finish_jitter_s
        if mean_s <= 0:
            return [0.0] * ranks
        expovariate = self._rng.expovariate
        rate = 1.0 / mean_s
        return [expovariate(rate) for _ in range(ranks)]

    def uniform(self, low: float, high: float) -> float:
        """A uniform draw from the same stream (telemetry wobble)."""
        return self._rng.uniform(low, high)

    def gauss(self, sigma: float) -> float:
        """A normal draw with mean 0 from the same stream."""
        return self._rng.gauss(0.0, sigma)
