"""The baselines' serving stack: standalone vLLM OpenAI servers and a third-party router
(sglang-router, vllm-router) in front of them, started as process groups and stopped whole."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from traces import BLOCK_TOKENS


def _spawn(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with log.open("ab") as out:
        return subprocess.Popen(command, env=os.environ | env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def stop(process: subprocess.Popen) -> None:
    """Stop a process and its whole session (vLLM's engine children included)."""
    for sig, wait_s in ((signal.SIGTERM, 60), (signal.SIGKILL, 30)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(wait_s)
            time.sleep(1)  # let children that outlive the leader go too
        except subprocess.TimeoutExpired:
            continue
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def start_engine(model: str, core: int, port: int, kv_bytes: int,
                 logs: Path) -> subprocess.Popen:
    """A vLLM OpenAI server on 127.0.0.1:`port`, its engine pinned to `core`; prefix caching
    and `POST /reset_prefix_cache` on, cached tokens reported in usage."""
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
               "--model", model, "--served-model-name", "tiny",
               "--host", "127.0.0.1", "--port", str(port), "--enforce-eager",
               "--max-model-len", "2048", "--dtype", "bfloat16", "--enable-prefix-caching",
               "--kv-cache-memory-bytes", str(kv_bytes), "--block-size", str(BLOCK_TOKENS),
               "--enable-prompt-tokens-details"]
    env = {"VLLM_CPU_OMP_THREADS_BIND": str(core), "VLLM_HOST_IP": "127.0.0.1",
           "VLLM_SERVER_DEV_MODE": "1"}
    return _spawn(command, env, logs / f"vllm-{port}.log")


def start_router(system: str, policy: str, port: int, metrics_port: int, workers: list[str],
                 logs: Path) -> subprocess.Popen:
    """sglang-router or vllm-router on 127.0.0.1:`port`, Prometheus on 127.0.0.1:`metrics_port`
    (sglang-router binds 0.0.0.0 unless both hosts are given)."""
    if system == "sglang-router":
        launcher = [sys.executable, "-m", "sglang_router.launch_router"]
    else:
        launcher = [str(Path(sys.executable).with_name("vllm-router"))]
    command = launcher + ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers,
                          "--policy", policy, "--prometheus-host", "127.0.0.1",
                          "--prometheus-port", str(metrics_port)]
    return _spawn(command, {}, logs / f"{system}-{policy}.log")


def _busy(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10, trust_env=False).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")))


def reset_prefix_caches(urls: list[str], timeout_s: float = 300) -> None:
    """Empty each engine's prefix cache; vLLM refuses while requests run, so wait for idle."""
    deadline = time.monotonic() + timeout_s
    for url in urls:
        while True:
            if _busy(url) == 0:
                response = httpx.post(f"{url}/reset_prefix_cache", timeout=30, trust_env=False)
                answer = response.json() if response.content.strip() else {}
                if response.status_code == 200 and answer.get("success", True):
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url}: prefix cache not reset after {timeout_s:g} s")
            time.sleep(1.0)
