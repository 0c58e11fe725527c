"""The host allocator's settings under which CPU timing measures programs, not the allocator.

On the CPU backend a device's buffers come from the process heap. glibc hands a freed block
larger than its mmap threshold (which grows to at most 32 MB) back to the operating system,
so a program whose temporaries exceed it faults their pages in again on every run, its
device threads contending for the kernel's memory map, and whether a program crosses the
threshold is an accident of its size. Accelerator runtimes pool device memory instead. So every process
that times programs runs with the threshold raised and trimming off (``POOLED``); glibc
reads these once, when the process starts.
"""
from __future__ import annotations

import os
import sys

POOLED = {"MALLOC_MMAP_THRESHOLD_": str(2**30), "MALLOC_TRIM_THRESHOLD_": str(2**34)}


def pooled() -> bool:
    """Whether this process started under ``POOLED``."""
    return all(os.environ.get(k) == v for k, v in POOLED.items())


def run_pooled() -> None:
    """Re-execute this process, with its own command line, under ``POOLED`` unless it runs so
    already (call it first thing: nothing before it survives)."""
    if not pooled():
        os.environ.update(POOLED)
        sys.stdout.flush()
        os.execv(sys.executable, [sys.executable] + sys.orig_argv[1:])
