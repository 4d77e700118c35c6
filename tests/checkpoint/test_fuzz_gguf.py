"""A short, fixed-seed run of scripts/fuzz_gguf.py: mutated headers of the default model end as a clean error or a
loaded file, never a crash, a hang or a memory blowup. Long campaigns are run by hand (docs/robustness.md)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_mutated_headers_give_no_crash_hang_or_blowup(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "fuzz_gguf.py"), "--cases", "60", "--seed", "0", "--jobs", "2",
         "--vocab-size", "2048", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    summary = json.loads(proc.stdout)
    counts = summary["counts"]
    assert summary["cases"] == 60 and counts["clean"] > 30, summary
    assert counts["crash"] == counts["hang"] == counts["memory"] == 0, summary["failures"]
    assert proc.returncode == 0
