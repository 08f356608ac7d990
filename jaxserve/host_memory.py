"""This process's resident host memory, for the loading figures: now, at peak, and the peak over
one span of code (`peak_during`).

Linux keeps a process's peak resident set (VmHWM in /proc/self/status) and lets the process
reset it (writing "5" to /proc/self/clear_refs), so `peak_during` measures a span exactly; the
reset also means a later lifetime-peak reading covers only the time since the last span began.
Where the reset is not possible the span's figure is the lifetime peak (ru_maxrss), an upper
bound, and says so (`exact` False).
"""

from __future__ import annotations

import contextlib
import dataclasses
import resource
import sys
from pathlib import Path

_STATUS = Path("/proc/self/status")


@dataclasses.dataclass
class PeakRSS:
    before_bytes: int  # resident when the span began
    peak_bytes: int = 0  # highest resident during the span (set when it ends)
    exact: bool = True  # False: the process's lifetime peak, an upper bound

    @property
    def added_bytes(self) -> int:
        return self.peak_bytes - self.before_bytes

    def describe(self) -> str:
        bound = "" if self.exact else " (lifetime peak: an upper bound)"
        return (f"host memory peak {self.peak_bytes / 2**20:.0f} MiB, {self.added_bytes / 2**20:+.0f} MiB "
                f"over the {self.before_bytes / 2**20:.0f} MiB before{bound}")


def _status_kib(field: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def rss_bytes() -> int:
    kib = _status_kib("VmRSS")
    return 0 if kib is None else kib * 1024


def peak_rss_bytes() -> int:
    kib = _status_kib("VmHWM")
    if kib is not None:
        return kib * 1024
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return maxrss if sys.platform == "darwin" else maxrss * 1024


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return _status_kib("VmHWM") is not None


@contextlib.contextmanager
def peak_during():
    """`with peak_during() as mem: ...`; then mem.peak_bytes, mem.added_bytes, mem.describe()."""
    exact = _reset_peak()
    mem = PeakRSS(rss_bytes(), exact=exact)
    try:
        yield mem
    finally:
        mem.peak_bytes = max(peak_rss_bytes(), mem.before_bytes)
