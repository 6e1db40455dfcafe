"""Measuring calls: median wall time, and peak memory in a fresh process.

Peak memory is the rise of this process's peak resident set over a baseline taken
after the inputs exist. Freed pages stay mapped in a long process, so each case runs in
its own interpreter; Linux also carries ru_maxrss across fork and exec (a child starts
at its parent's size), so the peak read is the process's own VmHWM.
"""

from __future__ import annotations

import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable


def peak_rss_kib() -> int:
    """Peak resident set of this process so far, KiB."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def peak_mib_of(fn: Callable[[], object]) -> float:
    """How far one call of fn raises this process's peak resident set, MiB."""
    before = peak_rss_kib()
    fn()
    return (peak_rss_kib() - before) / 1024


def peak_mib_in_subprocess(argv: list[str], timeout: float = 900) -> float:
    """Run `python *argv` in a fresh interpreter; it must print the MiB last."""
    return peaks_mib_in_subprocesses([argv], timeout)[0]


def peaks_mib_in_subprocesses(argvs: list[list[str]], timeout: float = 900) -> list[float]:
    """Run each `python *argv` in a fresh interpreter of its own, all at once: each reads
    its own process's peak, so running side by side changes no figure (it does change
    times: measure those before). Each must print the MiB last."""
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    procs = [subprocess.Popen([sys.executable, *argv], **pipes) for argv in argvs]
    try:
        done = [(p, *p.communicate(timeout=timeout)) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:  # a timeout, or an interrupt: none is left running
                p.kill()
    for p, _, err in done:
        if p.returncode != 0:
            raise subprocess.CalledProcessError(p.returncode, p.args, stderr=err)
    return [float(out.strip().splitlines()[-1]) for _, out, _ in done]


def median_ms(fn: Callable[[], object], reps: int = 5, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3
