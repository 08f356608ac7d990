"""scripts/bench_small_matmul.py sizes its pool of W copies from the L3 sysfs reports, so that the
"cold" figures come from DRAM on machines with a large L3 (a fixed 64 MB read L3 on a 480 MB-L3
Xeon); its parsing of sysfs cache sizes, on fake cache directories."""

import importlib.util

import pytest
from conftest import ROOT


def _script():
    spec = importlib.util.spec_from_file_location("_bench_small_matmul", ROOT / "scripts" / "bench_small_matmul.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cache(tmp_path, levels_sizes):
    for i, (level, size) in enumerate(levels_sizes):
        d = tmp_path / f"index{i}"
        d.mkdir(parents=True)
        (d / "level").write_text(f"{level}\n")
        (d / "size").write_text(f"{size}\n")
    return tmp_path


@pytest.mark.parametrize("size, mb", [("491520K", 491520 * 1024 / 1e6), ("32M", 32 * 2**20 / 1e6),
                                      ("1G", 2**30 / 1e6)])
def test_l3_size_is_read_from_the_level_3_cache_in_decimal_mb(tmp_path, size, mb):
    cache = _cache(tmp_path, [(1, "48K"), (1, "64K"), (2, "2048K"), (3, size)])
    assert _script().l3_mbytes(cache) == pytest.approx(mb)


def test_no_l3_or_an_unreadable_size_gives_none(tmp_path):
    script = _script()
    assert script.l3_mbytes(_cache(tmp_path / "a", [(1, "48K"), (2, "1024K")])) is None
    assert script.l3_mbytes(_cache(tmp_path / "b", [(3, "lots")])) is None
    assert script.l3_mbytes(tmp_path / "missing") is None
