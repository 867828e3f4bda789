"""The README's and the docs' commands, run as a newcomer would: the setup is idempotent, the main
job serves the tiny model on http://127.0.0.1:8000/v1 until Ctrl-C, then leaves nothing behind,
and every bash block of docs/*.md runs as written on the topology its marker names.

These run before tests/integration (pytest collects e2e first), never beside its cluster: the
main job's teardown stops every Ray process on the machine.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.conftest import leftover_processes
from tests.unit.test_docs import docs_blocks

ROOT = Path(__file__).resolve().parents[2]
ENV = os.environ | {"TOKENFAB_VENV": sys.prefix, "PYTHONUNBUFFERED": "1"}
# the docs' blocks call `tokenfab` and `ray` as from an activated virtualenv; with a Ray token on
# this machine, `ray job submit` needs RAY_AUTH_MODE=token (docs/deploy.md says so)
TOKEN = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray/auth_token")
DOCS_ENV = ENV | {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"} | (
    {"RAY_AUTH_MODE": "token"} if TOKEN.is_file() else {})


def test_setup_is_idempotent() -> None:
    subprocess.run(["bash", "scripts/setup.sh"], cwd=ROOT, env=ENV, check=True,
                   capture_output=True, timeout=900)
    started = time.monotonic()
    again = subprocess.run(["bash", "scripts/setup.sh"], cwd=ROOT, env=ENV, check=True,
                           capture_output=True, text=True, timeout=120)
    assert "setup: reusing virtualenv" in again.stdout
    assert "setup: reusing model" in again.stdout
    assert time.monotonic() - started < 30


def _wait_for_line(process: subprocess.Popen, needle: str, timeout_s: float) -> list[str]:
    lines, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line and process.poll() is not None:
            break
        lines.append(line)
        if needle in line:
            return lines
    raise AssertionError(f"no {needle!r} within {timeout_s} s:\n{''.join(lines[-40:])}")


def test_main_job_serves_until_ctrl_c(pytestconfig) -> None:
    pytestconfig._tokenfab_cluster_used = True
    process = subprocess.Popen(["bash", "scripts/serve.sh"], cwd=ROOT, env=ENV, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        lines = _wait_for_line(process, "serving; press Ctrl-C", 600)
        assert any("try: curl http://127.0.0.1:8000/v1/completions" in line for line in lines)
        assert any("pool-main: 1 starting" in line for line in lines)  # progress while waiting
        response = httpx.post("http://127.0.0.1:8000/v1/completions", trust_env=False, timeout=60,
                              json={"model": "tiny", "prompt": "Hello", "max_tokens": 5})
        assert response.status_code == 200
        assert response.json()["usage"]["completion_tokens"] == 5
        controller = next(p for p in psutil.process_iter(["cmdline"])
                          if " ".join(p.info["cmdline"] or ()).startswith("ray::ServeController"))
        # local.yaml's cluster.serve_control_loop_s reached Serve's controller through `ray start`
        assert controller.environ().get("RAY_SERVE_CONTROL_LOOP_INTERVAL_S") == "0.5"
        # nor Ray's log monitor (cluster.log_monitor is off): it would poll every log file 10x/s
        assert not [p for p in psutil.process_iter(["cmdline"])
                    if any(arg.endswith("log_monitor.py") for arg in p.info["cmdline"] or ())]
        os.killpg(process.pid, signal.SIGINT)
        output, _ = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 0, output
    assert "removed application local" in output and "stopped Ray" in output
    assert leftover_processes() == []


def readme_block(heading: str) -> list[str]:
    """The commands of the first bash block under `heading` in the README, comments dropped."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index(f"\n{heading}\n"):]
    block = section[section.index("```bash\n") + 8:]
    block = block[:block.index("```")]
    return [line.split("  #", 1)[0].strip() for line in block.splitlines() if line.strip()]


def run_docs_blocks(how: str) -> int:
    """Run each docs block marked `how`, a whole block in one shell that stops at a failure."""
    blocks = [(page, commands) for page, mark, commands in docs_blocks() if mark == how]
    for page, commands in blocks:
        result = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", commands], cwd=ROOT,
                                env=DOCS_ENV, text=True, capture_output=True, timeout=600)
        assert result.returncode == 0, f"{page}:\n{commands}\n{result.stdout}{result.stderr}"
    return len(blocks)


def test_using_it_runs_as_written(pytestconfig) -> None:
    """The README's block, with the docs' blocks for the local topology run before its `down`."""
    pytestconfig._tokenfab_cluster_used = True
    commands = readme_block("## Using it")
    assert commands[0].startswith(".venv/bin/tokenfab validate") and len(commands) >= 5
    assert commands[-1].endswith("tokenfab down --stop-ray")
    outputs: dict[str, str] = {}
    try:
        for command in commands:
            if command == commands[-1]:
                assert run_docs_blocks("with deploy/topologies/local.yaml") >= 2
            result = subprocess.run(command, shell=True, cwd=ROOT, env=ENV, text=True,
                                    capture_output=True, timeout=600)
            outputs[command] = result.stdout
            assert result.returncode == 0, f"$ {command}\n{result.stdout}{result.stderr}"
    finally:
        if len(outputs) < len(commands):  # stopped early: leave nothing behind
            subprocess.run(".venv/bin/tokenfab down --stop-ray", shell=True, cwd=ROOT, env=ENV,
                           capture_output=True, timeout=300)
    assert outputs[commands[0]].strip() == "ok"  # stdout; libraries' notices go to stderr
    status = next(out for command, out in outputs.items() if command.endswith("tokenfab status"))
    assert "main" in status and "healthy" in status.lower(), status
    assert leftover_processes() == []


OTHER_TOPOLOGIES = sorted({mark for _, mark, _ in docs_blocks()}
                          - {"with deploy/topologies/local.yaml"})


@pytest.mark.parametrize("how", OTHER_TOPOLOGIES)
def test_docs_blocks_run_as_written(how: str, pytestconfig) -> None:
    """Each other topology the docs' blocks need: up (unless the block deploys it), the blocks,
    then down, leaving nothing behind."""
    pytestconfig._tokenfab_cluster_used = True
    try:
        if how != "alone":
            up = subprocess.run([".venv/bin/tokenfab", "up", how.removeprefix("with ")], cwd=ROOT,
                                env=ENV, text=True, capture_output=True, timeout=900)
            assert up.returncode == 0, f"{up.stdout}{up.stderr}"
        assert run_docs_blocks(how) >= 1
    finally:
        down = subprocess.run([".venv/bin/tokenfab", "down", "--stop-ray"], cwd=ROOT, env=ENV,
                              text=True, capture_output=True, timeout=300)
    assert down.returncode == 0, f"{down.stdout}{down.stderr}"
    assert leftover_processes() == []
