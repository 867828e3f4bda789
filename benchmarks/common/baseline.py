"""The baselines' serving stack: standalone vLLM OpenAI servers and a third-party router
(sglang-router, vllm-router) in front of them, all in one session of their own.

One session is one scheduling group (Linux autogroup) for the whole stack, as `ray start` makes
one for all of tokenfab: the systems compared share the cores with the benchmark's client in the
same way (see h2h.py on the client's own group).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import psutil

from benchmarks.common.traces import BLOCK_TOKENS

_LAUNCHER = """
import json, os, subprocess, sys
for line in sys.stdin:
    spec = json.loads(line)
    with open(spec["log"], "ab") as out:
        child = subprocess.Popen(spec["cmd"], env=os.environ | spec["env"], stdout=out,
                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    print(child.pid, flush=True)
"""


class Process:
    """A process of the stack (its leader's child), by pid."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def poll(self) -> int | None:
        """None while it runs (as subprocess.Popen.poll)."""
        try:
            return None if _running(psutil.Process(self.pid)) else 1
        except psutil.NoSuchProcess:
            return 1


class Session:
    """A session leader that starts the stack's processes on request, so all share its session."""

    def __init__(self) -> None:
        self._leader = subprocess.Popen([sys.executable, "-c", _LAUNCHER], text=True,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        start_new_session=True)

    def spawn(self, command: list[str], env: dict[str, str], log: Path) -> Process:
        self._leader.stdin.write(json.dumps({"cmd": command, "env": env, "log": str(log)}) + "\n")
        self._leader.stdin.flush()
        return Process(int(self._leader.stdout.readline()))

    def close(self) -> None:
        """Stop every process of the session: its process group, orphans included."""
        members = _family(self._leader.pid)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self._leader.pid, sig)
            except ProcessLookupError:
                break
            members = _outliving(members, timeout_s=60)
        self._leader.wait(30)


def _running(process: psutil.Process) -> bool:
    """Whether it still runs. The leader never reaps the processes it starts, so one that ended
    stays a zombie (which psutil.wait_procs would wait for until its timeout)."""
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _outliving(members: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """The members still running after up to `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while (alive := [m for m in members if _running(m)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive


def _family(pid: int) -> list[psutil.Process]:
    """A process and all its descendants (none if it is gone)."""
    try:
        root = psutil.Process(pid)
        return [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        return []


def stop(process: Process) -> None:
    """Stop a process and its children (vLLM's engine processes included)."""
    members = _family(process.pid)
    for member in members:
        member.terminate()
    for member in _outliving(members, timeout_s=60):
        member.kill()


def kv_bytes_per_token(model: str) -> int:
    """Keys and values of one token in every layer, from the model's config (bfloat16)."""
    config = json.loads((Path(model).expanduser() / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 2


def start_engine(session: Session, model: str, core: int, port: int, kv_bytes: int,
                 logs: Path, extra: tuple[str, ...] = (),
                 env: dict[str, str] | None = None) -> Process:
    """A vLLM OpenAI server on 127.0.0.1:`port`, its engine pinned to `core`; prefix caching
    and `POST /reset_prefix_cache` on, cached tokens reported in usage, the render endpoints
    on (vllm-router tokenizes prompts through them: `check_prefix_inputs`); `extra` arguments
    after those (LoRA's, say), `env` added to its environment."""
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
               "--model", model, "--served-model-name", "tiny",
               "--host", "127.0.0.1", "--port", str(port), "--enforce-eager",
               "--max-model-len", "2048", "--dtype", "bfloat16", "--enable-prefix-caching",
               "--kv-cache-memory-bytes", str(kv_bytes), "--block-size", str(BLOCK_TOKENS),
               "--enable-prompt-tokens-details", "--enable-scale-out", *extra]
    env = {"VLLM_CPU_OMP_THREADS_BIND": str(core), "VLLM_HOST_IP": "127.0.0.1",
           "VLLM_SERVER_DEV_MODE": "1"} | (env or {})
    return session.spawn(command, env, logs / f"vllm-{port}.log")


def wait_ready(url: str, process: Process | None, timeout_s: float, path: str) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url + path, timeout=5, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{url}: the process exited")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}{path} not ready after {timeout_s:g} s")
        time.sleep(1.0)


@contextmanager
def routed(session: Session, system: str, policy: str, port: int, metrics_port: int,
           workers: list[str], logs: Path) -> Iterator[str]:
    """A router (start_router) while the block runs, ready (vllm-router cache_aware: routing by
    its prompts' tokens, `check_prefix_inputs`): its URL."""
    router = start_router(session, system, policy, port, metrics_port, workers, logs)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, router, 300, "/v1/models")
        if system == "vllm-router" and policy == "cache_aware":
            check_prefix_inputs(url, metrics_port)
        yield url
    finally:
        stop(router)


def check_prefix_inputs(url: str, metrics_port: int) -> None:
    """One request through vllm-router's cache_aware, which must have been routed by its prompt's
    tokens. vllm-router asks each worker to render a prompt (`/v1/completions/render`) before it
    routes; where a worker refuses (vLLM serves that route only with `--enable-scale-out`) it
    routes every request to the least loaded worker and says so only in its metrics (outcome
    `missing_tokens`), so a benchmark would measure least-loaded routing under its name."""
    probe = {"model": "tiny", "prompt": "a probe of the router's prefix inputs", "max_tokens": 1}
    httpx.post(f"{url}/v1/completions", json=probe, timeout=60, trust_env=False
               ).raise_for_status()
    outcomes = prefix_outcomes(httpx.get(f"http://127.0.0.1:{metrics_port}/metrics",
                                         timeout=10, trust_env=False).text)
    if outcomes.get("missing_tokens") or not outcomes:
        raise RuntimeError(f"vllm-router cache_aware did not route by the prompt's tokens "
                           f"(its decisions by outcome: {outcomes}); are the workers' render "
                           "endpoints on (vLLM's --enable-scale-out)?")


def prefix_outcomes(metrics: str) -> dict[str, float]:
    """vllm-router's cache_aware decisions by outcome, summed over stages, from its Prometheus
    text: `prefix_hit`, `prefix_miss`, `load_imbalance`, `missing_tokens`."""
    from prometheus_client.parser import text_string_to_metric_families

    outcomes: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics):
        for sample in family.samples:
            if sample.name == "vllm_router_prefix_routing_decisions_total" \
                    and "outcome" in sample.labels:
                outcome = sample.labels["outcome"]
                outcomes[outcome] = outcomes.get(outcome, 0.0) + sample.value
    return outcomes


def start_router(session: Session, system: str, policy: str, port: int, metrics_port: int,
                 workers: list[str], logs: Path) -> Process:
    """sglang-router or vllm-router on 127.0.0.1:`port`, Prometheus on 127.0.0.1:`metrics_port`
    (sglang-router binds 0.0.0.0 unless both hosts are given)."""
    if system == "sglang-router":
        launcher = [sys.executable, "-m", "sglang_router.launch_router"]
    else:
        launcher = [str(Path(sys.executable).with_name("vllm-router"))]
    command = launcher + ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers,
                          "--policy", policy, "--prometheus-host", "127.0.0.1",
                          "--prometheus-port", str(metrics_port)]
    return session.spawn(command, {}, logs / f"{system}-{policy}.log")


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
