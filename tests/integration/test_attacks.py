"""Attacks on the running gateway, from 127.0.0.1 with bounded loops (topology-attacks.yaml: the
gateway served from the pool's two replicas with real engines, auth on, every limit at its
default but the stalled-client timeout, 2 s): readers that stop reading, idle connections,
slowloris, oversized heads and bodies, request smuggling shapes and pipelining. During or after
each, a fresh request is answered within FRESH_S (FRESH_BUSY_S beside the unread streams, whose
tokens the engines are still generating)."""

from __future__ import annotations

import re
import select
import socket
import statistics
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import httpx
import psutil
import pytest

from orchestrator.config import Topology
from orchestrator.status import gateway_url
from tests.integration.conftest import ROOT, up
from tests.promql import scrape

TOPOLOGY = ROOT / "tests/integration/topology-attacks.yaml"
ADMIN = {"authorization": "Bearer admin-key"}
TENANT = {"authorization": "Bearer alpha-key"}
FRESH_S = 0.2  # a one-token completion on a new connection, median of 5
# the same while the engines generate the 60 unread streams (until they are dropped): it shares
# their batches
FRESH_BUSY_S = 2.0
STREAMS, TOKENS = 60, 1500  # unread streams, and what each asks for
GROWTH_BYTES = 50 << 20  # what the unread streams may add to the serving processes, all together
STATUS = re.compile(rb"HTTP/1\.1 (\d{3}) ")


@pytest.fixture(scope="module")
def attacked(ray_cluster) -> Topology:
    with up(TOPOLOGY) as topology:
        yield topology


def fresh_request_s(root: str, count: int = 5) -> float:
    """The median time of `count` one-token completions, each on a connection of its own."""
    times = []
    for _ in range(count):
        began = time.perf_counter()
        answer = httpx.post(f"{root}/v1/completions", headers=TENANT, trust_env=False,
                            json={"model": "tiny", "prompt": "fresh", "max_tokens": 1},
                            timeout=30)
        times.append(time.perf_counter() - began)
        assert answer.status_code == 200, answer.text
    return statistics.median(times)


def port(topology: Topology) -> int:
    return topology.gateway.port


def connect(topology: Topology, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:  # before connecting, so the window it offers stays small
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", port(topology)))
    return sock


def exchange(topology: Topology, data: bytes, timeout_s: float = 10.0) -> bytes:
    """Everything the gateway says to `data` on one connection until it closes it."""
    with connect(topology) as sock:
        sock.settimeout(timeout_s)
        sock.sendall(data)
        said = b""
        while chunk := sock.recv(65536):
            said += chunk
        return said


def closed(sock: socket.socket) -> bool:
    """Whether the gateway has closed `sock` (reading what it said before)."""
    while select.select([sock], [], [], 0)[0]:
        try:
            if not sock.recv(65536):
                return True
        except ConnectionError:
            return True
    return False


@contextmanager
def sockets(count: int, topology: Topology) -> Iterator[list[socket.socket]]:
    with ExitStack() as stack:
        yield [stack.enter_context(connect(topology)) for _ in range(count)]


def test_slowloris_heads_are_cut_and_fresh_requests_still_answer(attacked: Topology) -> None:
    """100 connections trickle a head, one header a second: the server closes them at its head
    timeout (10 s), at least 90% within 60 s, while fresh requests answer."""
    root = gateway_url(attacked)
    with sockets(100, attacked) as trickling:
        for sock in trickling:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\n")
        began, fresh, gone = time.monotonic(), [], set()
        while len(gone) < 90 and time.monotonic() - began < 60:
            for index, sock in enumerate(trickling):
                if index not in gone:
                    if closed(sock):
                        gone.add(index)
                    else:
                        sock.sendall(b"X-Slow: %d\r\n" % int(time.monotonic() - began))
            if len(fresh) < 2:
                fresh.append(fresh_request_s(root))
            time.sleep(1.0)
        assert len(gone) >= 90, f"{len(gone)} of 100 closed in 60 s"
        assert time.monotonic() - began < 20  # at the head timeout, not at the idle one
    assert max(fresh) < FRESH_S, fresh


def test_idle_connections_leave_fresh_requests_fast(attacked: Topology) -> None:
    with sockets(800, attacked):
        assert fresh_request_s(gateway_url(attacked)) < FRESH_S


def test_oversized_heads_and_bodies_are_refused(attacked: Topology) -> None:
    head = b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer alpha-key\r\n"
    big_header = head + b"X-Big: " + b"a" * (100 << 10) + b"\r\n\r\n"
    body = b"{" + b" " * (2 << 20) + b"}"
    sized = head + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
    chunked = head + b"Transfer-Encoding: chunked\r\n\r\n" + b"".join(
        b"%x\r\n%s\r\n" % (len(part), part) for part in [body[i:i + 65536]
                                                        for i in range(0, len(body), 65536)])
    for data, status in ((big_header, b"431"), (sized + body, b"413"),
                         (chunked + b"0\r\n\r\n", b"413")):
        said = exchange(attacked, data)
        assert STATUS.findall(said) == [status], said[:300]
    assert fresh_request_s(gateway_url(attacked)) < FRESH_S


@pytest.mark.parametrize("shape, status", [
    # both lengths: which one ends the body decides where a smuggled request would begin
    (b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", b"400"),
    (b"Content-Length: 4\r\nContent-Length: 40\r\n\r\n{}{}", b"400"),
    (b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n", b"400"),
    # framed as chunked, but in a coding the gateway does not decode (RFC 9112: 501)
    (b"Transfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n", b"501"),
    (b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", b"400"),
    (b"Content-Length : 4\r\n\r\n{}{}", b"400"),
    (b"Content-Length: -4\r\n\r\n{}{}", b"400"),
])
def test_smuggling_shapes_are_refused_and_nothing_behind_them_is_served(
        attacked: Topology, shape: bytes, status: bytes) -> None:
    smuggled = b"GET /v1/models HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer alpha-key\r\n\r\n"
    said = exchange(attacked, b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\n"
                    b"Authorization: Bearer alpha-key\r\n" + shape + smuggled)
    assert STATUS.findall(said) == [status], said[:400]
    assert fresh_request_s(gateway_url(attacked)) < FRESH_S


def test_pipelined_requests_are_answered_in_order(attacked: Topology) -> None:
    models = b"GET /v1/models HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer alpha-key\r\n"
    health = b"GET /nowhere HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer alpha-key\r\n"
    said = exchange(attacked, models + b"\r\n" + health + b"\r\n" + models
                    + b"Connection: close\r\n\r\n")
    assert STATUS.findall(said) == [b"200", b"404", b"200"], said[:600]
    assert fresh_request_s(gateway_url(attacked)) < FRESH_S


def _serving(root: str) -> list[psutil.Process]:
    reports = httpx.get(f"{root}/tokenfab/replicas", headers=ADMIN, trust_env=False, timeout=30)
    assert reports.status_code == 200, reports.text
    return [psutil.Process(r["pid"]) for r in reports.json()]


def _engine(topology: Topology, replicas: set[str]) -> dict[str, float]:
    """The engines' own series of this application: tokens generated and requests running."""
    agent = f"http://127.0.0.1:{topology.cluster.metrics_export_port}/metrics"
    out = {"generated": 0.0, "running": 0.0}
    for sample in scrape(agent):
        if sample.labels.get("ReplicaId") not in replicas:
            continue
        if sample.name == "ray_vllm_generation_tokens_total":
            out["generated"] += sample.value
        elif sample.name == "ray_vllm_num_requests_running":
            out["running"] += sample.value
    return out


def test_stalled_readers_are_dropped_stopped_in_the_engine_and_held_in_bounded_memory(
        attacked: Topology) -> None:
    """60 streams of 1,500 tokens whose clients read nothing (a 4 KiB receive window): each is
    dropped 2 s after 64 KiB of it waits in the gateway, its engine request ends there (the
    engines generate far fewer than 60 x 1,500 tokens, and run nothing after), and the serving
    processes hold a bounded amount meanwhile."""
    root = gateway_url(attacked)
    processes = _serving(root)
    replicas = {r["replica_id"] for r in httpx.get(
        f"{root}/tokenfab/replicas", headers=ADMIN, trust_env=False, timeout=30).json()}
    before = sum(p.memory_info().rss for p in processes)
    generated = _engine(attacked, replicas)["generated"]
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer alpha-key\r\n"
               b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n")
    body = (b'{"model": "tiny", "prompt": "never read", "max_tokens": %d, "ignore_eos": true, '
            b'"stream": true}' % TOKENS)
    stalled = _stalled(root)
    with ExitStack() as stack:
        unread = [stack.enter_context(connect(attacked, rcvbuf=4096)) for _ in range(STREAMS)]
        for sock in unread:
            sock.sendall(request % len(body) + body)
        began, peak, dropped = time.monotonic(), before, 0
        busy = fresh_request_s(root, count=1)  # beside 60 streams the engines generate
        while dropped < STREAMS and time.monotonic() - began < 60:
            peak = max(peak, sum(p.memory_info().rss for p in processes))
            dropped = _stalled(root) - stalled  # read on the server's side: the client reads nothing
            time.sleep(0.2)
        assert dropped == STREAMS, f"{dropped} of {STREAMS} unread streams dropped in 60 s"
        for sock in unread:  # now read: what the kernel still held, then the end, cut short
            sock.settimeout(10)
            said = b""
            while chunk := sock.recv(1 << 20):
                said += chunk
            assert said.startswith(b"HTTP/1.1 200 ") and b"data: [DONE]" not in said
    held = peak - before
    print(f"unread streams: {held / STREAMS / 1024:.0f} KiB held per stream at the peak "
          f"({held / 2**20:.1f} MiB for {STREAMS}), all dropped after "
          f"{time.monotonic() - began:.1f} s; a fresh request beside them took {busy:.2f} s")
    assert held <= GROWTH_BYTES, f"the serving processes grew by {held / 2**20:.1f} MiB"
    assert busy < FRESH_BUSY_S, busy
    deadline = time.monotonic() + 60  # Ray's agent exports what engines recorded every few s
    while True:
        engine = _engine(attacked, replicas)
        if engine["running"] == 0 and engine["generated"] > generated:
            break
        assert time.monotonic() < deadline, f"the engines still run {engine}"
        time.sleep(2)
    assert engine["generated"] - generated < STREAMS * TOKENS / 2, engine
    assert fresh_request_s(root) < FRESH_S


def _stalled(root: str) -> float:
    """Connections the gateway dropped because their client read nothing (every ingress's)."""
    return sum(sample.value for sample in scrape(f"{root}/metrics", "admin-key")
               if sample.name == "tokenfab_gateway_connection_limits_total"
               and sample.labels.get("reason") == "stalled_client")
