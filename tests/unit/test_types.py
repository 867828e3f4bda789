"""mypy, strict, holds over the modules named in pyproject.toml [tool.mypy] (router/, channel/
and orchestrator/gateway/, and the modules they import): the suite fails on a finding, as CI runs
the suite. Locally: `.venv/bin/mypy`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_mypy_strict_finds_nothing(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
