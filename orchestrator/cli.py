"""The `tokenfab` command: validate topologies, make tiny models, and bring deployments up and
down."""

from __future__ import annotations

import json
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import click

from orchestrator.config import (ClusterSpec, Topology, load_topology, parse_topology,
                                 topology_schema)
from tokenfab.errors import ClusterError, TokenfabError, TopologyError

DEFAULT_CLUSTER = ClusterSpec()


def _fail(exc: TokenfabError) -> None:
    problems = exc.problems if isinstance(exc, TopologyError) else [str(exc)]
    for line in problems:
        click.echo(f"error: {line}", err=True)
    sys.exit(1)


def check_engine_args(topology: Topology, source: str) -> list[str]:
    """Names in engine_args that vLLM does not know, as `file: field.path: message` lines."""
    from pools.vllm_engine import engine_arg_names

    known = engine_arg_names()
    sections = [("engine_args", topology.engine_args)]
    sections += [(f"pools.{i}.engine_args", pool.engine_args)
                 for i, pool in enumerate(topology.pools)]
    return [
        f"{source}: {where}.{key}: unknown vLLM engine argument"
        for where, args in sections
        for key in args
        if key not in known
    ]


def _load(path: str, engine_args: bool = True) -> Topology:
    topology = load_topology(path)
    problems = check_engine_args(topology, path) if engine_args else []
    if problems:
        raise TopologyError(problems)
    return topology


@click.group()
def main() -> None:
    """tokenfab: LLM serving pools, routing and gateway on Ray."""


@main.command()
@click.argument("file", type=click.Path(dir_okay=False))
def validate(file: str) -> None:
    """Check a topology file; print "ok" or one error per line (exit 1)."""
    try:
        _load(file)
    except TokenfabError as exc:
        _fail(exc)
    click.echo("ok")


@main.command()
def schema() -> None:
    """Print the JSON Schema of topology files."""
    click.echo(json.dumps(topology_schema(), indent=2))


@main.command("topology-reference")
def topology_reference() -> None:
    """Print the topology file reference in Markdown (docs/topology-reference.md)."""
    from orchestrator.topology_reference import render

    click.echo(render(), nl=False)


@main.command("chart-schema")
def chart_schema() -> None:
    """Print the JSON Schema of the Helm chart's values
    (deploy/helm/tokenfab/values.schema.json)."""
    from orchestrator.helm_schema import values_schema

    click.echo(json.dumps(values_schema(), indent=2))


@main.command("hash-key")
@click.argument("key", required=False)
@click.option("--generate", is_flag=True, help="Make a new random key and print it first.")
def hash_key_command(key: str | None, generate: bool) -> None:
    """Print the digest a topology stores for an API key (KEY, or one line of stdin)."""
    import secrets

    from orchestrator.gateway.tenancy import hash_key

    if generate:
        key = "tf-" + secrets.token_urlsafe(32)
        click.echo(key)
    elif key is None:
        key = sys.stdin.readline().strip()
    if not key:
        raise click.UsageError("give a KEY, one line on stdin, or --generate")
    click.echo(hash_key(key))


@main.command("dashboard")
def dashboard() -> None:
    """Print the Grafana dashboard (deploy/dashboards/tokenfab.json)."""
    from orchestrator.dashboard import dashboard as build

    click.echo(json.dumps(build(), indent=2))


@main.group()
def model() -> None:
    """Generate models that need no download."""


@model.command()
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Target directory.")
@click.option("--moe", is_flag=True, help="A tiny mixture-of-experts (Mixtral) instead of Llama.")
@click.option("--seed", default=0, show_default=True, help="Weights and tokenizer seed.")
@click.option("--if-missing", is_flag=True, help="Keep a model already at --out.")
@click.option("--lora", default=0, show_default=True, type=click.IntRange(min=0),
              help="Also write N deterministic LoRA adapters, in <out>-lora/lora-0 ... lora-N-1.")
def tiny(out: str, moe: bool, seed: int, if_missing: bool, lora: int) -> None:
    """Build a deterministic tiny random-weight model with its own tokenizer."""
    from pools.tiny_lora import adapter_name, ensure_tiny_adapter
    from pools.tiny_model import build_tiny_model, ensure_tiny_model, model_digest

    if lora and moe:
        raise click.UsageError("--lora: tiny adapters are made for the dense tiny model")
    target = Path(out).expanduser()
    if if_missing:
        path = ensure_tiny_model(target, moe=moe)
    else:
        path = build_tiny_model(target, moe=moe, seed=seed)
    click.echo(f"{path} sha256:{model_digest(path)}")
    adapters = target.parent / f"{target.name}-lora"
    for index in range(lora):
        where = ensure_tiny_adapter(path, adapters / adapter_name(index), index)
        click.echo(f"{where} sha256:{model_digest(where)}")


@main.command()
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--foreground", is_flag=True, help="Serve until Ctrl-C, then tear everything down.")
@click.option("--timeout", default=900.0, show_default=True, help="Seconds to wait for engines.")
def up(file: str, foreground: bool, timeout: float) -> None:
    """Start or join Ray, deploy FILE, wait until every replica is healthy."""
    from orchestrator import deploy

    try:
        topology = _load(file)
        started = _ensure_ray(topology)
        client = deploy.ServeClient(topology.cluster.dashboard_url)
        click.echo(f"deploying {topology.name!r}: " + ", ".join(
            f"pool {p.name} ({p.role}) x{p.replicas}" for p in topology.pools))
        client.deploy(topology)
        deploy.wait_until_running(client, topology.name, timeout,
                                  lambda line: click.echo(f"  {line}"))
    except TokenfabError as exc:
        _fail(exc)
    gateway = topology.gateway
    base = f"http://{gateway.host}:{gateway.port}{gateway.route_prefix.rstrip('/')}/v1"
    click.echo(f"ready: OpenAI endpoint {base}")
    click.echo(f"try: curl {base}/completions -H 'Content-Type: application/json' "
               f"-d '{{\"model\": \"{topology.served[0].name}\", \"prompt\": \"Hello\", "
               f"\"max_tokens\": 16}}'")
    if foreground:
        _serve_until_interrupted(topology, stop_ray=started)


def _ensure_ray(topology: Topology) -> bool:
    from orchestrator import cluster

    if cluster.dashboard_up(topology.cluster.dashboard_url):
        click.echo(f"using the Ray cluster at {topology.cluster.address}")
        return False
    click.echo(f"starting a local Ray head on {topology.cluster.node_ip} ...")
    cluster.start_head(topology.cluster)
    return True


def _serve_until_interrupted(topology: Topology, stop_ray: bool) -> None:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    click.echo("serving; press Ctrl-C to stop")
    stop.wait()
    click.echo("stopping ...")
    _down(topology.name, topology.cluster, stop_ray)


@main.command()
@click.option("--app", default=None, help="Application name (default: the only one deployed).")
@click.option("--dashboard", default=DEFAULT_CLUSTER.dashboard_url, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def status(app: str | None, dashboard: str, as_json: bool) -> None:
    """Pools, replicas, health and load."""
    from orchestrator.status import collect, collect_scaling, render, render_scaling

    try:
        rows, counters = collect(dashboard, app)
        scaling = collect_scaling(dashboard, app)
    except TokenfabError as exc:
        _fail(exc)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    click.echo(render(rows))
    if scaling:
        click.echo(render_scaling(scaling))
    if counters:
        click.echo("prefill/decode: " + ", ".join(f"{k}={v}" for k, v in sorted(counters.items())))


@main.command()
@click.option("--app", default=None, help="Application name (default: the only one deployed).")
@click.option("--dashboard", default=DEFAULT_CLUSTER.dashboard_url, show_default=True)
@click.option("--interval", default=1.0, show_default=True, help="Seconds between redraws.")
@click.option("--once", is_flag=True, help="Print one screen and exit.")
def top(app: str | None, dashboard: str, interval: float, once: bool) -> None:
    """Every pool replica's load, latency and health, redrawn in place (Ctrl-C quits)."""
    from rich.console import Console

    from orchestrator.top import read, render, run

    if once:
        frame = read(dashboard, app)
        Console().print(render(frame))
        if frame.error is not None:
            sys.exit(1)
        return
    try:
        run(dashboard, app, interval)
    except KeyboardInterrupt:
        pass


@main.command()
@click.argument("pool")
@click.argument("replicas", type=int)
@click.option("--app", default=None, help="Application name (default: the only one deployed).")
@click.option("--dashboard", default=DEFAULT_CLUSTER.dashboard_url, show_default=True)
@click.option("--timeout", default=600.0, show_default=True)
def scale(pool: str, replicas: int, app: str | None, dashboard: str, timeout: float) -> None:
    """Set POOL's replica count; in-flight requests on removed replicas finish first."""
    from orchestrator import deploy
    from orchestrator.status import deployed_topology

    try:
        client = deploy.ServeClient(dashboard)
        topology = deployed_topology(client, app)
        pools = [p.model_dump() if p.name != pool else p.model_dump() | {"replicas": replicas}
                 for p in topology.pools]
        if pool not in {p.name for p in topology.pools}:
            raise TopologyError([f"pool {pool!r} is not in application {topology.name!r}"])
        if topology.autoscaled(topology.pool(pool)):
            spec = topology.pool(pool)
            raise TopologyError([f"pool {pool!r} is autoscaled between {spec.min_replicas} and "
                                 f"{spec.max_replicas} replicas: change its bounds in the "
                                 "topology, or set autoscaler.enabled: false"])
        data: dict[str, Any] = topology.model_dump() | {"pools": pools}
        updated = parse_topology(data, f"scale {pool} {replicas}")
        client.deploy(updated)
        deploy.wait_until_running(client, updated.name, timeout,
                                  lambda line: click.echo(f"  {line}"))
    except TokenfabError as exc:
        _fail(exc)
    click.echo(f"pool {pool}: {replicas} replicas")


@main.group()
def adapter() -> None:
    """LoRA adapters of a running application (its topology sets model.lora). With auth on,
    $TOKENFAB_ADMIN_KEY must hold an admin key."""


@adapter.command("list")
@click.option("--app", default=None, help="Application name (default: the only one deployed).")
@click.option("--dashboard", default=DEFAULT_CLUSTER.dashboard_url, show_default=True)
def adapter_list(app: str | None, dashboard: str) -> None:
    """Every adapter served, and the replicas that hold it loaded now."""
    from orchestrator.status import adapter_call

    try:
        rows = adapter_call(dashboard, app, "GET")
    except TokenfabError as exc:
        _fail(exc)
    for row in rows:
        owners = ",".join(row["tenants"]) if row["tenants"] is not None else "all tenants"
        kind = "declared" if row["declared"] else "loaded"
        held = ",".join(row["held_by"]) or "-"
        click.echo(f"{row['name']}  {kind}  {owners}  held by: {held}  {row['path']}")


@adapter.command("load")
@click.argument("name")
@click.argument("path")
@click.option("--tenant", "tenants", multiple=True,
              help="Private to this tenant (repeat for several); default: every tenant.")
@click.option("--app", default=None, help="Application name (default: the only one deployed).")
@click.option("--dashboard", default=DEFAULT_CLUSTER.dashboard_url, show_default=True)
def adapter_load(name: str, path: str, tenants: tuple[str, ...], app: str | None,
                 dashboard: str) -> None:
    """Serve the adapter at PATH (on every node) as NAME, from now on."""
    from orchestrator.status import adapter_call

    body = {"name": name, "path": str(Path(path).expanduser().resolve())
            if Path(path).expanduser().exists() else path, "tenants": list(tenants) or None}
    try:
        adapter_call(dashboard, app, "POST", body=body)
    except TokenfabError as exc:
        _fail(exc)
    click.echo(f"adapter {name}: loaded")


@adapter.command("unload")
@click.argument("name")
@click.option("--app", default=None, help="Application name (default: the only one deployed).")
@click.option("--dashboard", default=DEFAULT_CLUSTER.dashboard_url, show_default=True)
def adapter_unload(name: str, app: str | None, dashboard: str) -> None:
    """Stop serving NAME (an adapter loaded at run time): requests for it get 404."""
    from orchestrator.status import adapter_call

    try:
        adapter_call(dashboard, app, "DELETE", name=name)
    except TokenfabError as exc:
        _fail(exc)
    click.echo(f"adapter {name}: unloaded")


@main.command()
@click.option("--app", default=None, help="Application name (default: every tokenfab application).")
@click.option("--dashboard", default=DEFAULT_CLUSTER.dashboard_url, show_default=True)
@click.option("--stop-ray", is_flag=True,
              help="Also stop the Ray head that tokenfab started for this dashboard.")
def down(app: str | None, dashboard: str, stop_ray: bool) -> None:
    """Remove deployments; optionally stop the local Ray."""
    cluster_spec = DEFAULT_CLUSTER.model_copy(update={"dashboard_url": dashboard})
    try:
        _down(app, cluster_spec, stop_ray)
    except ClusterError as exc:
        _fail(exc)


def _down(app: str | None, cluster_spec: ClusterSpec, stop_ray: bool) -> None:
    from orchestrator import cluster, deploy

    if cluster.dashboard_up(cluster_spec.dashboard_url):
        client = deploy.ServeClient(cluster_spec.dashboard_url)
        names = [app] if app else [a["name"] for a in client.deployed_apps()
                                   if a.get("import_path") == deploy.IMPORT_PATH]
        for name in names:
            if client.delete(name):
                deploy.wait_until_gone(client, name, timeout_s=180)
                click.echo(f"removed application {name}")
    if stop_ray:
        cluster.stop_ray(cluster_spec.dashboard_url)
        click.echo("stopped Ray")


if __name__ == "__main__":
    main()
