"""Tests for the `tokenfab validate` and `tokenfab schema` commands."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from orchestrator.cli import main

LOCAL = Path(__file__).resolve().parents[2] / "deploy" / "topologies" / "local.yaml"
TYPOS = """\
name: t
model: {name: m, path: /models/m}
engine_args: {enforce_eagre: true}
pools:
  - name: main
    resources: {kv_cache_bytes: 1MiB}
    engine_args: {max_num_seqs: 4, max_num_seqz: 4}
"""


def test_validate_shipped_local_and_unknown_engine_args(tmp_path: Path) -> None:
    # Both cases import vLLM's argument list; kept in one test so the import is paid once.
    ok = CliRunner().invoke(main, ["validate", str(LOCAL)])
    assert (ok.exit_code, ok.stdout, ok.stderr) == (0, "ok\n", "")

    path = tmp_path / "typo.yaml"
    path.write_text(TYPOS)
    bad = CliRunner().invoke(main, ["validate", str(path)])
    assert (bad.exit_code, bad.stdout) == (1, "")
    assert bad.stderr.splitlines() == [
        f"error: {path}: engine_args.enforce_eagre: unknown vLLM engine argument",
        f"error: {path}: pools.0.engine_args.max_num_seqz: unknown vLLM engine argument",
    ]


def test_validate_reports_each_field_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("name: Bad\nmodel: {name: m, path: /m}\npools: [{name: main, replicas: 0}]\n")
    result = CliRunner().invoke(main, ["validate", str(path)])
    assert (result.exit_code, result.stdout) == (1, "")
    assert result.stderr.splitlines() == [
        f"error: {path}: name: String should match pattern '^[a-z][a-z0-9-]{{0,30}}$'",
        f"error: {path}: pools.0.replicas: Input should be greater than or equal to 1",
    ]


def test_validate_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.yaml"
    result = CliRunner().invoke(main, ["validate", str(path)])
    assert (result.exit_code, result.stderr) == (
        1, f"error: {path}: cannot read: No such file or directory\n")


def test_schema_is_json_schema_of_topology() -> None:
    result = CliRunner().invoke(main, ["schema"])
    assert (result.exit_code, result.stderr) == (0, "")
    schema = json.loads(result.stdout)
    assert {"model", "pools"} <= set(schema["properties"])
    assert schema["additionalProperties"] is False
    assert schema["required"] == ["name", "pools"]
    assert schema["oneOf"] == [{"required": ["model"]}, {"required": ["models"]}]


def test_hash_key_prints_the_digest_a_topology_stores() -> None:
    from orchestrator.gateway.tenancy import Tenants, hash_key

    given = CliRunner().invoke(main, ["hash-key", "my-key"])
    piped = CliRunner().invoke(main, ["hash-key"], input="my-key\n")
    assert given.exit_code == piped.exit_code == 0
    assert given.stdout == piped.stdout == hash_key("my-key") + "\n"
    generated = CliRunner().invoke(main, ["hash-key", "--generate"])
    key, digest = generated.stdout.split()
    assert len(key) > 32 and digest == hash_key(key)
    from orchestrator.config import parse_topology

    topology = parse_topology({
        "name": "t", "model": {"name": "m", "path": "/m"}, "auth": {"enabled": True},
        "pools": [{"name": "p", "resources": {"kv_cache_bytes": "1MiB"}}],
        "tenants": [{"name": "a", "api_keys": [digest]}]})
    assert Tenants(topology).authenticate(f"Bearer {key}").name == "a"
    empty = CliRunner().invoke(main, ["hash-key"], input="")
    assert empty.exit_code == 2 and "KEY" in empty.stderr
