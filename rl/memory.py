"""Peak memory of a phase of a step (rollout, update): the GPU's allocated bytes where there is one, else
the process's resident set (which holds the in-process vLLM engine too).

    reset_peak()          # before the phase
    ...                   # the phase
    peak_gib()            # its peak since the reset, in GiB

On the CPU the peak is the kernel's high-water mark of the resident set (VmHWM), which writing "5" to
/proc/self/clear_refs resets (Linux 4.0 and later); where that is refused, peaks are since the process began.
"""

from __future__ import annotations

from pathlib import Path

import torch


def reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        return
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:  # not Linux, or not allowed: the peak then runs from the process's start
        pass


def peak_gib() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # (kB on Linux, where /proc exists)
    kib = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:"))
    return kib / 2**20
