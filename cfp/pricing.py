"""Prices of the combinations a profile has not measured (``passes/profile.py``, the profile
search drives): each combination's analytic price (``cfp.analytic``) split into its parts
(compute, collectives, the bytes it holds, its operators), the parts weighted by a fit to what
this run measured, and the band the measured times fall in around the fit. An unmeasured
combination is priced at the band's low end: the least it may take, given what was measured.

    >>> import numpy as np
    >>> from cfp.pricing import fit_prices
    >>> parts = np.array([[1.0, 0.0, 0, 1], [1.0, 1.0, 0, 1], [2.0, 1.0, 0, 1]])
    >>> fit = fit_prices(parts, 2 * parts[:, 0] + 3 * parts[:, 1])
    >>> round(fit.low_end(np.array([3.0, 2.0, 0, 1])), 6), round(fit.low_ratio, 6)
    (12.0, 1.0)
"""
from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from cfp.measure import Measurement

# The parts of a price, in the order of ``parts``' columns
PARTS = ("compute_s", "collective_s", "held_bytes", "operators")


def parts(m: Measurement, operators: int, cost, mesh_shape) -> np.ndarray:
    """The parts of the analytic price ``m`` (``cfp.analytic.window_measurement``) of a window
    of ``operators`` operators."""
    collective_s = sum(cost.collective_s(kind, axes, nbytes, mesh_shape)
                       for kind, axes, nbytes in m.collectives)
    return np.array([max(m.time_s - collective_s, 0.0), collective_s,
                     float(m.peak_bytes), float(operators)])


@dataclasses.dataclass(frozen=True)
class Fit:
    """Seconds as non-negative weights of the parts, and the least and most ratio of a
    measured time to its fitted price."""

    weights: np.ndarray
    low_ratio: float
    high_ratio: float
    measured: int

    def price(self, part: np.ndarray) -> float:
        return float(part @ self.weights)

    def low_end(self, part: np.ndarray) -> float:
        """The least seconds a combination of these parts may take: its fitted price times
        the least ratio measured."""
        return max(self.low_ratio * self.price(part), 0.0)


def fit_prices(measured_parts: np.ndarray, seconds: np.ndarray) -> Fit:
    """Non-negative weights of the parts (rows of ``measured_parts``) fitted to the measured
    ``seconds`` by least relative error: every subset of the parts solved by least squares,
    the best whose weights are all non-negative kept (exact non-negative least squares for a
    handful of parts). A time of 0 or less (what was measured was within the launch overhead
    subtracted) says nothing of the weights: it is left out."""
    x = np.asarray(measured_parts, float)
    y = np.asarray(seconds, float)
    usable = (y > 0) & np.isfinite(y) & np.isfinite(x).all(axis=1)
    if not usable.any():  # nothing took measurable time: the low end is nothing
        return Fit(np.zeros(x.shape[1]), 0.0, 0.0, 0)
    x, y = x[usable], y[usable]
    scale = np.where(x.max(axis=0) > 0, x.max(axis=0), 1.0)  # columns on one scale
    a = x / scale / y[:, None]  # relative error: each row divided by its time
    best, best_err = np.zeros(x.shape[1]), float("inf")
    for size in range(1, x.shape[1] + 1):
        for cols in itertools.combinations(range(x.shape[1]), size):
            w, *_ = np.linalg.lstsq(a[:, cols], np.ones(len(y)), rcond=None)
            if (w < 0).any():
                continue
            err = float(np.sum((a[:, cols] @ w - 1) ** 2))
            if err < best_err:
                best_err, best = err, np.zeros(x.shape[1])
                best[list(cols)] = w
    weights = best / scale
    fitted = x @ weights
    ratio = y / np.where(fitted > 0, fitted, np.inf)
    return Fit(weights, float(ratio.min()), float(ratio.max()), len(y))
