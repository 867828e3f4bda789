"""Every third-party module the project imports comes from a distribution pyproject.toml
declares. A package's module-level imports need only the base install (`dependencies`); an
import inside a function (a path that needs an engine, say) and the engine packages, tests and
benchmarks may use an extra too (vLLM is the `cpu` or `gpu` extra)."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("orchestrator", "router", "pools", "kvtransfer", "autoscaler", "channel", "tokenfab",
            "sim")
FIRST_PARTY = set(PACKAGES) | {"tests", "benchmarks", "scripts"}


def imported_modules(folder: Path, nested: bool = True) -> dict[str, str]:
    """Top-level module -> the first file that imports it (absolute imports only); without
    `nested`, only the imports that run when the module is imported (none inside a function)."""
    found: dict[str, str] = {}
    for path in sorted(folder.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        skip = set() if nested else {id(n) for f in ast.walk(tree)
                                     if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                                     for n in ast.walk(f)}
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and \
                node.module else []
            for name in names:
                found.setdefault(name.split(".")[0], str(path.relative_to(ROOT)))
    return found


def third_party(modules: dict[str, str]) -> dict[str, str]:
    return {m: f for m, f in modules.items()
            if m not in sys.stdlib_module_names and m not in FIRST_PARTY}


def declared() -> tuple[set[str], set[str]]:
    """Distributions the packages may import, and those everything else may import too."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    name = lambda req: re.split(r"[\[<>=!~; ]", req, maxsplit=1)[0].lower().replace("_", "-")  # noqa: E731
    core = {name(r) for r in project["dependencies"]}
    extras = {name(r) for group in project["optional-dependencies"].values() for r in group}
    return core, core | extras


def undeclared(modules: dict[str, str], allowed: set[str]) -> list[str]:
    owners = packages_distributions()
    missing = []
    for module, where in sorted(modules.items()):
        dists = {d.lower().replace("_", "-") for d in owners.get(module, ())} or {module}
        if not dists & allowed:
            missing.append(f"{module} (imported by {where}; from {sorted(dists) or 'nowhere'})")
    return missing


# imported only where a setting asks for it, as vLLM itself does: the engines' xxhash prefix
# hashes (`prefix_caching_hash_algo`), which need the xxhash package installed by hand
OPTIONAL = {"xxhash"}


def test_the_packages_import_only_the_declared_dependencies() -> None:
    core, everything = declared()
    modules: dict[str, str] = {}
    for package in PACKAGES:
        if package not in ("pools", "kvtransfer"):  # the engine packages may use the extras
            modules |= imported_modules(ROOT / package, nested=False)
    assert undeclared(third_party(modules), core) == []
    lazily = {}
    for package in PACKAGES:
        lazily |= imported_modules(ROOT / package)
    assert undeclared(third_party(lazily), everything | OPTIONAL) == []


def test_tests_benchmarks_and_engine_packages_import_declared_dependencies() -> None:
    _, everything = declared()
    modules: dict[str, str] = {}
    for folder in ("pools", "kvtransfer", "tests", "benchmarks", "scripts"):
        if (ROOT / folder).is_dir():
            modules |= imported_modules(ROOT / folder)
    assert undeclared(third_party(modules), everything) == []
