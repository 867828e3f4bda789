"""The import rules of ../shared/STYLE.md, checked on the source (every import statement, also
those inside functions): who may import vLLM, which packages may import which, no cycles between
packages, and a request path (orchestrator/gateway) that reads only the topology schema of the
control plane around it."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("orchestrator", "router", "pools", "kvtransfer", "autoscaler", "channel", "tokenfab",
            "sim")
# package -> packages of ours it must not import (the gateway is orchestrator.gateway)
FORBIDDEN = {
    "router": {"pools", "orchestrator", "autoscaler", "kvtransfer", "channel"},
    "autoscaler": {"pools", "orchestrator", "router", "kvtransfer", "channel"},
    "pools": {"orchestrator"},
    "kvtransfer": {"orchestrator", "pools", "router", "autoscaler", "channel"},
    "channel": {"orchestrator", "pools", "router", "autoscaler", "kvtransfer"},
    "tokenfab": set(PACKAGES) - {"tokenfab"},
    # the simulator runs the router and the autoscaler as they are, around simulated engines
    "sim": {"pools", "orchestrator", "kvtransfer", "channel"},
}
VLLM_ALLOWED = {"pools", "kvtransfer"}


def modules_imported_by(path: Path) -> set[str]:
    """Full names of every module `path` imports."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def imports_of(path: Path) -> set[str]:
    """Top-level names of every module `path` imports."""
    return {name.split(".")[0] for name in modules_imported_by(path)}


def package_imports() -> dict[str, dict[str, set[str]]]:
    """package -> imported name -> the modules of the package that import it."""
    graph: dict[str, dict[str, set[str]]] = {}
    for package in PACKAGES:
        edges: dict[str, set[str]] = defaultdict(set)
        for path in (ROOT / package).rglob("*.py"):
            for name in imports_of(path):
                edges[name].add(str(path.relative_to(ROOT)))
        graph[package] = edges
    return graph


GRAPH = package_imports()


def test_every_package_is_checked() -> None:
    found = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests", "benchmarks"}
    assert found <= set(PACKAGES), f"new package(s) without import rules: {found - set(PACKAGES)}"


@pytest.mark.parametrize("package", PACKAGES)
def test_only_pools_and_kvtransfer_import_vllm(package: str) -> None:
    if package not in VLLM_ALLOWED:
        assert "vllm" not in GRAPH[package], GRAPH[package].get("vllm")


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_forbidden_package_imports(package: str) -> None:
    offending = {name: sorted(where) for name, where in GRAPH[package].items()
                 if name in FORBIDDEN[package]}
    assert offending == {}


def test_no_cycles_between_packages() -> None:
    edges = {p: {name for name in GRAPH[p] if name in PACKAGES and name != p} for p in PACKAGES}

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(n == goal or (n not in seen and reaches(n, goal, seen | {n}))
                   for n in edges[start])

    cycles = [p for p in PACKAGES if reaches(p, p, set())]
    assert cycles == [], {p: sorted(edges[p]) for p in cycles}


TOPOLOGY_SCHEMA = {"orchestrator.config", "orchestrator.tenant_config", "orchestrator.strict",
                   "orchestrator.adapter_config", "orchestrator.gateway_config",
                   "orchestrator.pool_config"}


def test_the_request_path_reads_only_the_schema_of_the_control_plane() -> None:
    """orchestrator.gateway may import the topology's schema (TOPOLOGY_SCHEMA) and itself; the
    control plane's actions (deploy, cluster, CLI, status) stay out of the request path."""
    offending = {}
    for path in (ROOT / "orchestrator/gateway").rglob("*.py"):
        bad = sorted(name for name in modules_imported_by(path)
                     if name.startswith("orchestrator") and name not in TOPOLOGY_SCHEMA
                     and not name.startswith("orchestrator.gateway"))
        if bad:
            offending[str(path.relative_to(ROOT))] = bad
    assert offending == {}
