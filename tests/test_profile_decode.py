"""scripts/profile_decode.py runs on the tiny model and its parts add up to a sane table (a smoke
test: the figures themselves are the machine's)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import profile_decode  # noqa: E402


def test_profile_decode_on_the_tiny_model(capsys):
    (res,) = profile_decode.main(["--model", str(ROOT / "tests" / "data" / "llama_mqa"), "--rows", "2",
                                  "--reps", "1", "--context-min", "20", "--context-max", "40"])
    out = capsys.readouterr().out
    assert "rows 2 (bucket 2" in out and out.splitlines()[-1].startswith("RESULT ")
    parts = res["parts"]
    assert set(parts) == {k for k, _ in profile_decode.LABELS}
    assert all(parts[k]["ms"] > 0 for k in parts if k != "rest")
    assert parts["step"]["share"] == 1.0
    # The step's compulsory bytes: weights plus the two rows' KV (contexts 20..40 + the new token).
    assert res["step_bytes_mb"] > 0 and 20 <= res["contexts_mean"] <= 40
