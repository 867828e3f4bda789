"""ruff's lint rules (pyproject.toml [tool.ruff]) hold over the whole tree: the suite fails on a
finding, as CI runs the suite. Locally: `.venv/bin/ruff check .` (`--fix` for the safe ones)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ruff_finds_nothing() -> None:
    ruff = Path(sys.executable).with_name("ruff")
    result = subprocess.run([str(ruff), "check", "--output-format", "concise", "."], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
