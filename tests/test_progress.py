"""The load progress bar (checkpoints/progress.py): one tick per tensor read, its length the
checkpoint's tensor count, quantize-on-load renaming it; and nothing at all when stderr is not a
terminal or nobody opened a bar. Reads the tiny tests/data checkpoint's float tensors only."""

import io
import sys

from conftest import ROOT

from checkpoints import progress
from checkpoints.hf import load_hf_params, open_safetensors
from checkpoints.quantize import QuantizeSpec, load_quantized_params

TINY = ROOT / "tests" / "data" / "llama_mqa"


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_load_ticks_once_per_tensor_on_a_terminal(monkeypatch):
    monkeypatch.setattr(sys, "stderr", _Terminal())
    with open_safetensors(TINY) as (names, _):
        n = len(names)
    with progress.bar("loading weights") as b:
        load_hf_params(TINY)
        assert (b.n, b.total) == (n, n)  # the tiny model has no fused tensors: each read once
    with progress.bar("loading weights") as b:
        load_quantized_params(TINY, QuantizeSpec("int8"))
        assert b.n == n and b.desc.startswith("quantizing to int8")
    assert "loading weights" in sys.stderr.getvalue()


def test_no_bar_when_not_a_terminal_or_not_asked(monkeypatch):
    out = io.StringIO()  # isatty() is False: a pipe, a log file, a test
    monkeypatch.setattr(sys, "stderr", out)
    with progress.bar("loading weights") as b:
        assert b is None
        load_hf_params(TINY)
    monkeypatch.setattr(sys, "stderr", _Terminal())
    with progress.bar("loading weights", enabled=False) as b:
        assert b is None
    load_hf_params(TINY)  # no bar open: tick() is a no-op
    assert out.getvalue() == "" and sys.stderr.getvalue() == ""


def test_entry_points_show_bars_only_to_a_person_at_info_level(monkeypatch):
    import argparse

    from jaxserve import flags
    monkeypatch.setattr(sys, "stderr", _Terminal())
    ns = argparse.Namespace
    assert flags.progress_enabled(ns(log_level="info")) is True
    assert flags.progress_enabled(ns(log_level="warning")) is False
    assert flags.progress_enabled(ns(log_level="info", no_progress=True)) is False
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert flags.progress_enabled(ns(log_level="info")) is False
    monkeypatch.setattr(sys, "stderr", _Terminal())
    from jaxserve.cli import build_parser
    assert flags.progress_enabled(build_parser().parse_args(["serve", "--no-progress"])) is False
    assert flags.progress_enabled(build_parser().parse_args(["serve"])) is True
