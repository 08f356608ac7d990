"""jaxserve/host_memory.py: the peak over a span sees an allocation already freed, and a new
span starts from the current resident set, not the process's old peak."""

import sys

import numpy as np
import pytest

from jaxserve import host_memory

MiB = 2**20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the exact span needs /proc/self/clear_refs")
def test_peak_during_a_span_sees_a_freed_allocation_and_resets_after():
    with host_memory.peak_during() as m:
        a = np.ones(200 * MiB // 8)  # 200 MiB, touched
        del a
    assert m.exact
    assert m.added_bytes >= 190 * MiB, m.describe()
    assert host_memory.rss_bytes() < m.peak_bytes - 150 * MiB  # it was freed
    with host_memory.peak_during() as quiet:
        pass
    assert quiet.added_bytes < 50 * MiB, quiet.describe()  # the old peak does not carry over


@pytest.mark.parametrize("tp", [1, 2])
def test_loading_reports_its_peak(tp, tmp_path):
    from tp_cases import write_tiny_tp_folder

    from jaxserve import loading
    from sharding.mesh import make_mesh
    lm = loading.load(write_tiny_tp_folder(tmp_path), mesh=make_mesh(tp=tp) if tp > 1 else None)
    m = lm.load_memory
    assert m is not None and m.exact and m.peak_bytes >= m.before_bytes > 0
    assert "host memory peak" in m.describe()
