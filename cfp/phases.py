"""Where a pass's time goes: wall seconds summed per named phase.

    >>> phases = Phases()
    >>> with phases("compiling"):
    ...     pass
    >>> sorted(phases.seconds)
    ['compiling']
"""
from __future__ import annotations

import contextlib
import time


class Phases:
    """Wall seconds per phase name; phases may be entered many times and from several
    processes (``add`` merges another process's totals)."""

    def __init__(self, seconds: dict[str, float] | None = None):
        self.seconds: dict[str, float] = dict(seconds or {})

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add({name: time.perf_counter() - start})

    def add(self, seconds: dict[str, float]) -> None:
        for name, s in seconds.items():
            self.seconds[name] = self.seconds.get(name, 0.0) + s

    def take(self) -> dict[str, float]:
        """The totals so far, and start afresh (a worker reports them per message)."""
        out, self.seconds = self.seconds, {}
        return out
