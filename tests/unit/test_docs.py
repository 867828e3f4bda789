"""The documentation holds together: the README stays short, every relative link and anchor
resolves, the topology reference is the schema's, and the product speaks of itself only."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from orchestrator.topology_reference import render

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\(([^)\s]+)\)")
BASH = re.compile(r"^(?:<!-- test: (.+?) -->\n)?```bash\n(.*?)^```", re.S | re.M)
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def tracked(*patterns: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard",
                          *patterns], cwd=ROOT, check=True, capture_output=True, text=True)
    return [ROOT / line for line in out.stdout.splitlines() if (ROOT / line).exists()]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"^[a-z]+:", target):
            continue  # http(s), mailto: not checked here
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading with that anchor")
    return broken


def test_slug_follows_github() -> None:
    assert slug("Security: what is protected, and what an operator configures") == \
        "security-what-is-protected-and-what-an-operator-configures"
    assert slug("One process per request path: `gateway.colocate`") == \
        "one-process-per-request-path-gatewaycolocate"


def test_broken_links_are_found(tmp_path: Path) -> None:
    (tmp_path / "b.md").write_text("# A heading\n")
    page = tmp_path / "a.md"
    page.write_text("[ok](b.md#a-heading) [gone](c.md) [bad](b.md#nowhere) [web](https://x.y)\n"
                    "```\n[in code](d.md)\n```\n")
    assert broken_links(page) == ["c.md: no such file", "b.md#nowhere: no heading with that anchor"]


@pytest.mark.parametrize("page", tracked("*.md"), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    assert broken_links(page) == []


def test_readme_reads_in_minutes() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300


def test_topology_reference_is_current() -> None:
    assert (ROOT / "docs/topology-reference.md").read_text() == render(), \
        "regenerate: tokenfab topology-reference > docs/topology-reference.md"


def test_no_development_history() -> None:
    """Results and docs name a date or a commit, never a working session of the project's."""
    found = [f"{path.relative_to(ROOT)}:{number}"
             for path in tracked() if "tests" not in path.relative_to(ROOT).parts[:1]
             and path.suffix in (".md", ".py", ".yaml", ".sh", ".json", ".txt")
             for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
             if re.search(r"\bsession [0-9]", line)]
    assert found == []


def docs_blocks() -> list[tuple[str, str, str]]:
    """(page, how the test runs it, commands) for every bash block of docs/*.md. `<!-- test: with
    TOPOLOGY -->` before a block: run once TOPOLOGY is up; `<!-- test: alone -->`: the block
    deploys what it needs (tests/e2e/test_readme_commands.py runs them; this file checks them)."""
    return [(str(page.relative_to(ROOT)), how or "", commands)
            for page in sorted((ROOT / "docs").glob("*.md"))  # not analysis/: benchmark runs
            for how, commands in BASH.findall(page.read_text())]


def test_every_docs_command_block_says_how_the_test_runs_it() -> None:
    blocks = docs_blocks()
    assert len(blocks) >= 5
    for page, how, _ in blocks:
        assert how == "alone" or how.startswith("with "), f"{page}: a bash block without a marker"
        if how != "alone":
            assert (ROOT / how.removeprefix("with ")).is_file(), f"{page}: {how}"
