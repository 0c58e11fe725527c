"""One interrupt policy for every phase: Ctrl-C is one line and exit status 130.

``CtrlC`` holds SIGINT while the passes run; ``interrupted`` tells a Ctrl-C from what it became
on its way up. The solver's own part of the policy is in ``cfp.solver``.
"""
from __future__ import annotations

import gc
import os
import signal
import sys
import threading


def interrupted(e: BaseException | None) -> bool:
    """Whether ``e`` is a Ctrl-C, or what one became: an extension module interrupted while
    it was imported raises ``ImportError`` from the ``KeyboardInterrupt``."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, KeyboardInterrupt):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


class CtrlC:
    """SIGINT while the passes run: ``KeyboardInterrupt``, as Python's own handler raises it,
    but never inside the garbage collector, where Python would print and ignore it (JAX's
    collector callback is often where a Ctrl-C lands): there it is sent again, by a thread
    of its own, once the collection ends. It is remembered too, for one lost in a
    ``__del__`` run outside a collection (Python's report of it is not printed): ``check``
    raises it again. A SIGINT ignored when the run starts (under ``nohup``, or in a
    background job) stays ignored."""

    def __init__(self):
        self.seen = self.in_gc = self.deferred = self.closing = False
        self.previous = self.hook = None
        self.resend, self.lock = threading.Event(), threading.Lock()

    def __enter__(self):
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN):  # nohup's stays
            self.previous = signal.signal(signal.SIGINT, self._handler)
            self.hook, sys.unraisablehook = sys.unraisablehook, self._unraisable
            gc.callbacks.insert(0, self._gc_starts)
            gc.callbacks.append(self._gc_ends)
            threading.Thread(target=self._resender, name="ctrl-c", daemon=True).start()
        return self

    def __exit__(self, *exc):
        if self.previous is None:
            return False
        with self.lock:  # no Ctrl-C is sent again from here on
            self.closing = True
            self.resend.set()
        self._flush()  # one sent before runs its handler now, while it is still ours
        gc.callbacks.remove(self._gc_starts)
        gc.callbacks.remove(self._gc_ends)
        signal.signal(signal.SIGINT, self.previous)
        sys.unraisablehook = self.hook
        return False

    @staticmethod
    def _flush() -> None:
        """A call: where Python runs the handlers of signals that have arrived."""

    def _handler(self, signum, frame):
        self.seen = True
        if self.closing:
            return  # the run stops already
        if self.in_gc:
            self.deferred = True
            return
        raise KeyboardInterrupt

    def _resender(self):
        while True:
            self.resend.wait()
            with self.lock:
                self.resend.clear()
                if self.closing:
                    return
                os.kill(os.getpid(), signal.SIGINT)

    def _gc_starts(self, phase, info):
        if phase == "start":
            self.in_gc = True

    def _gc_ends(self, phase, info):
        if phase == "stop":
            self.in_gc = False
            if self.deferred:
                self.deferred = False
                self.resend.set()

    def _unraisable(self, unraisable) -> None:
        if not (self.seen and isinstance(unraisable.exc_value, KeyboardInterrupt)):
            self.hook(unraisable)

    def check(self) -> None:
        if self.seen:
            raise KeyboardInterrupt
