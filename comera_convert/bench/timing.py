"""Timing and memory measurement for `comera bench`: medians after warm-up, CUDA-aware."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch


def median_seconds(fn, repeats: int, warmup: int = 2, device: str = "cpu") -> float:
    """Median wall time of ``fn()`` over ``repeats`` runs after ``warmup`` runs.

    On CUDA each run is timed with events around a synchronized stream.
    """
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            begin = time.perf_counter()
            fn()
            times.append(time.perf_counter() - begin)
    return statistics.median(times)


def graphed(step, warmup: int = 3):
    """``step`` captured once as a CUDA graph; the returned callable replays it (same tensors, no
    Python or kernel-launch overhead). Warm-up runs on a side stream first, as capture requires."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


class PeakMemory:
    """Peak memory of a block above what was resident when it began (bytes).

    CUDA: max_memory_allocated. CPU: the process's peak RSS (VmHWM, reset through
    /proc/self/clear_refs) above its RSS at the start; run it in a fresh subprocess so other
    work of the same process does not count.
    """

    def __init__(self, device: str):
        self.device = device
        self.bytes = 0

    def __enter__(self):
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            Path("/proc/self/clear_refs").write_text("5")  # resets the peak RSS to the current RSS
            self.base = _status_kib("VmRSS") * 1024
        return self

    def __exit__(self, *exc):
        if self.device == "cuda":
            torch.cuda.synchronize()
            self.bytes = torch.cuda.max_memory_allocated() - self.base
        else:
            self.bytes = _status_kib("VmHWM") * 1024 - self.base
        return False
