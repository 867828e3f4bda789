"""The Helm chart, rendered and checked without a cluster: lint, every rendered document against
its schema (RayService against KubeRay's CRD, core kinds against Kubernetes'), the embedded
topology against tokenfab's own validation, and bad values refused with a readable error."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import helm_python as helm  # the test extra: missing, the module fails (not skipped)
import pytest
import yaml

from orchestrator.config import parse_topology
from orchestrator.deploy import application_config, topology_of
from orchestrator.helm_schema import values_schema
from orchestrator.gateway.tenancy import Tenants, hash_key, read_admin_key_file, read_key_file

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy/helm/tokenfab"

def _crd_dir() -> Path:
    """KubeRay's CRDs from the shared reference folder beside the checkout (not vendored)."""
    candidates = [Path(p) for p in [os.environ.get("TOKENFAB_KUBERAY_CRDS", "")] if p]
    candidates += [ROOT.parent / "shared/k8s", Path("/work/shared/k8s")]
    for path in candidates:
        if (path / "ray.io_rayservices.yaml").exists():
            return path
    raise FileNotFoundError(f"KubeRay CRDs not found in {candidates}; set TOKENFAB_KUBERAY_CRDS")


CRDS = _crd_dir()
EXAMPLES = sorted((CHART / "examples").glob("*.yaml"))
KUBERNETES = "1.30"


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    chart = helm.Chart.load(str(CHART))
    try:
        out = chart.render(values, name="demo", namespace="llm")
    finally:
        chart.close()
    return [doc for path, text in sorted(out.items()) if path.endswith(".yaml")
            for doc in yaml.safe_load_all(text) if doc]


def crd_schema(kind: str) -> dict[str, Any]:
    crd = yaml.safe_load((CRDS / f"ray.io_{kind.lower()}s.yaml").read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return _int_or_string(version["schema"]["openAPIV3Schema"])


def _int_or_string(node: Any) -> Any:
    """KubeRay's `x-kubernetes-int-or-string` as plain JSON Schema."""
    if isinstance(node, dict):
        node = {k: _int_or_string(v) for k, v in node.items()}
        if node.pop("x-kubernetes-int-or-string", False):
            node.pop("type", None)
            node["anyOf"] = [{"type": "integer"}, {"type": "string"}]
        return node
    if isinstance(node, list):
        return [_int_or_string(item) for item in node]
    return node


@pytest.fixture(scope="module", params=EXAMPLES, ids=[p.stem for p in EXAMPLES])
def rendered(request) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    values = yaml.safe_load(request.param.read_text())
    return values, render(values)


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_lint_passes(example: Path) -> None:
    result = helm.lint(str(CHART), yaml.safe_load(example.read_text()))
    assert result["errors"] == [], result
    assert [m for m in result["messages"] if m["severity"] > 1] == []  # info only (no icon)


def test_values_schema_is_generated_from_the_topology_models() -> None:
    committed = json.loads((CHART / "values.schema.json").read_text())
    assert committed == values_schema(), "regenerate: tokenfab chart-schema > " \
        "deploy/helm/tokenfab/values.schema.json"


def test_every_document_validates(rendered) -> None:
    import jsonschema
    import kubernetes_validate

    _, docs = rendered
    kinds = sorted(doc["kind"] for doc in docs)
    assert {"RayService", "ConfigMap", "Service"} <= set(kinds)
    for doc in docs:
        if doc["apiVersion"].startswith("ray.io/"):
            jsonschema.Draft7Validator(crd_schema(doc["kind"])).validate(doc)
        elif doc["apiVersion"].startswith("monitoring.coreos.com/"):
            assert doc["kind"] in ("ServiceMonitor", "PodMonitor")
        else:
            kubernetes_validate.validate(doc, KUBERNETES, strict=True)


def test_rayservice_applies_what_tokenfab_up_applies(rendered) -> None:
    values, docs = rendered
    by_kind = {doc["kind"]: doc for doc in docs}
    topology = parse_topology(yaml.safe_load(by_kind["ConfigMap"]["data"]["topology.yaml"]),
                              "rendered ConfigMap")
    serve = yaml.safe_load(by_kind["RayService"]["spec"]["serveConfigV2"])
    (app,) = serve["applications"]
    expected = application_config(topology)
    assert topology_of(app) == topology
    assert {k: app[k] for k in ("name", "route_prefix", "import_path", "deployments")} == \
        {k: expected[k] for k in ("name", "route_prefix", "import_path", "deployments")}
    assert serve["proxy_location"] == "Disabled"  # the gateway serves HTTP itself, on the head
    http = next(p for p in by_kind["Service"]["spec"]["ports"] if p["name"] == "http")
    assert (topology.gateway.host, topology.gateway.port) == ("0.0.0.0", http["targetPort"])
    declared = values["topology"].get("models") or [values["topology"]["model"]]
    assert [model.path for model in topology.served] == [model["path"] for model in declared]
    assert topology.cluster.node_ip is None  # each node's own address, found through Ray
    cluster = by_kind["RayService"]["spec"]["rayClusterConfig"]
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    assert set(groups) == {pool.role for pool in topology.pools}
    for pool in topology.pools:
        assert pool.resources.ray_resources == {f"tokenfab-{pool.role}": 1}
        group = groups[pool.role]
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        if pool.parallel.backend == "ray":  # vLLM spreads the ranks over the group's pods
            assert limits["nvidia.com/gpu"] >= pool.parallel.tensor
            assert limits["nvidia.com/gpu"] * group["replicas"] >= \
                pool.resources.gpus * pool.replicas
        else:
            assert limits["nvidia.com/gpu"] >= pool.resources.gpus
        assert f"tokenfab-{pool.role}" in group["rayStartParams"]["resources"]
    head = cluster["headGroupSpec"]["template"]["metadata"]["labels"]
    service = by_kind["Service"]
    assert all(head[k] == v for k, v in service["spec"]["selector"].items())


def test_the_adapters_volume_is_mounted_read_only_in_every_pod() -> None:
    values = yaml.safe_load((CHART / "examples/models-and-adapters.yaml").read_text())
    cluster = next(d for d in render(values) if d["kind"] == "RayService")["spec"][
        "rayClusterConfig"]
    pods = [cluster["headGroupSpec"]["template"]["spec"]] + [
        group["template"]["spec"] for group in cluster["workerGroupSpecs"]]
    for pod in pods:
        assert {"name": "adapters", **values["adapters"]["volume"]} in pod["volumes"]
        mounts = pod["containers"][0]["volumeMounts"]
        assert {"name": "adapters", "mountPath": "/adapters", "readOnly": True} in mounts
    without = render(values | {"adapters": {"mountPath": "/adapters", "volume": {}}})
    cluster = next(d for d in without if d["kind"] == "RayService")["spec"]["rayClusterConfig"]
    assert "adapters" not in str(cluster)


def test_tenant_keys_go_to_a_secret_never_the_configmap(tmp_path: Path) -> None:
    values = yaml.safe_load((CHART / "examples/llama3-8b-pd-h100.yaml").read_text())
    digest = hash_key("a-new-key")
    keys = values["tenantKeys"] | {"acme": [*values["tenantKeys"]["acme"], digest]}
    docs = render(values | {"tenantKeys": keys})
    by_kind = {doc["kind"]: doc for doc in docs}
    secret = by_kind["Secret"]["stringData"]["tenant-keys.yaml"]
    assert digest in secret
    assert digest not in json.dumps(by_kind["ConfigMap"]) + json.dumps(by_kind["RayService"])
    topology = parse_topology(yaml.safe_load(by_kind["ConfigMap"]["data"]["topology.yaml"]))
    assert topology.auth.enabled and topology.auth.key_file == \
        "/etc/tokenfab-secrets/tenant-keys.yaml"
    head = by_kind["RayService"]["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]
    mounts = {m["mountPath"] for c in head["spec"]["containers"] for m in c["volumeMounts"]}
    assert str(Path(topology.auth.key_file).parent) in mounts
    (tmp_path / "keys.yaml").write_text(secret)  # what the gateway reads there
    tenants = Tenants(topology, read_key_file(tmp_path / "keys.yaml"))
    assert tenants.authenticate("Bearer a-new-key").name == "acme"


def test_admin_keys_go_to_the_secret_and_prometheus_presents_one(tmp_path: Path) -> None:
    values = yaml.safe_load((CHART / "examples/llama3-8b-pd-h100.yaml").read_text())
    by_kind = {doc["kind"]: doc for doc in render(values)}
    digests = yaml.safe_load(by_kind["Secret"]["stringData"]["admin-keys.yaml"])
    assert digests == values["adminKeys"]
    assert digests[0] not in json.dumps(by_kind["ConfigMap"]) + json.dumps(by_kind["RayService"])
    topology = parse_topology(yaml.safe_load(by_kind["ConfigMap"]["data"]["topology.yaml"]))
    (tmp_path / "admin.yaml").write_text(by_kind["Secret"]["stringData"]["admin-keys.yaml"])
    tenants = Tenants(topology, extra_admin_keys=read_admin_key_file(tmp_path / "admin.yaml"))
    tenants.authenticate_admin("Bearer example-admin-key")  # the example's key, in clear
    assert topology.auth.admin_key_file == "/etc/tokenfab-secrets/admin-keys.yaml"
    (gateway, _agent) = by_kind["ServiceMonitor"]["spec"]["endpoints"]
    assert gateway["authorization"] == {"type": "Bearer", "credentials": {
        "name": "tokenfab-admin", "key": "admin-key"}}
    # with auth on, a ServiceMonitor that could not authenticate is refused at render time
    with pytest.raises(helm.HelmError, match="adminKeySecret"):
        render(values | {"serviceMonitor": {"enabled": True}})


def test_salt_key_secret_is_mounted_as_the_salt_key_file() -> None:
    values = yaml.safe_load((CHART / "examples/llama3-8b-pd-h100.yaml").read_text())
    by_kind = {d["kind"]: d for d in render(values | {"saltKeySecret": {"name": "tf-salt"}})}
    topology = parse_topology(yaml.safe_load(by_kind["ConfigMap"]["data"]["topology.yaml"]))
    assert topology.auth.salt_key_file == "/etc/tokenfab-salt/salt-key"
    head = by_kind["RayService"]["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    assert {"name": "salt-key", "secret": {"secretName": "tf-salt"}} in head["volumes"]
    mounts = {m["mountPath"] for c in head["containers"] for m in c["volumeMounts"]}
    assert "/etc/tokenfab-salt" in mounts
    plain = {d["kind"]: d for d in render(values)}  # by default: the GCS key, no file
    assert parse_topology(yaml.safe_load(plain["ConfigMap"]["data"]["topology.yaml"])
                          ).auth.salt_key_file is None


def test_network_policy_opens_only_the_gateway_beyond_the_release() -> None:
    values = yaml.safe_load((CHART / "examples/llama3-8b-pd-h100.yaml").read_text())
    docs = render(values)
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    release = {"matchLabels": {"app.kubernetes.io/instance": "demo"}}
    service = next(d for d in docs if d["kind"] == "RayService")["spec"]["rayClusterConfig"]
    pods = [service["headGroupSpec"]] + service["workerGroupSpecs"]
    for pod in pods:  # every pod of the release is isolated by a policy
        labels = pod["template"]["metadata"]["labels"]
        assert any(p["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
                   and p["spec"]["policyTypes"] == ["Ingress"] for p in policies), labels
    gateway_port = parse_topology(yaml.safe_load(next(
        d for d in docs if d["kind"] == "ConfigMap")["data"]["topology.yaml"])).gateway.port
    operator = yaml.safe_load((CHART / "values.yaml").read_text())["networkPolicy"]["operatorFrom"]
    for policy in policies:
        for rule in policy["spec"]["ingress"]:
            ports = sorted(p["port"] for p in rule.get("ports", []))
            peers = rule.get("from")
            if peers == [{"podSelector": release}]:
                continue  # the release's own pods
            assert ports, f"{policy['metadata']['name']} opens every port beyond the release"
            if peers is None:  # anyone
                assert ports == [gateway_port], policy["metadata"]["name"]
            elif 8265 in ports:  # the dashboard and job API: only the KubeRay operator
                assert ports == [8265] and peers == operator
            else:
                assert ports == [8080]  # metrics, only to peers the values name
    assert not [d for d in render(values | {"networkPolicy": {"enabled": False}})
                if d["kind"] == "NetworkPolicy"]
    with pytest.raises(helm.HelmError, match="metricsFrom"):  # Prometheus could not scrape
        render(values | {"networkPolicy": {"metricsFrom": []}})


GROUP = {"replicas": 1, "minReplicas": 1, "maxReplicas": 1, "gpusPerPod": 1, "cpu": "8",
         "memory": "32Gi"}
POOL = {"name": "main", "role": "unified", "resources": {"cpus": 8, "gpus": 1}}
MODEL = {"name": "m", "path": "org/m"}


@pytest.mark.parametrize(("values", "message"), [
    ({"topology": {"name": "x", "pools": [POOL]}}, "missing property 'model'"),
    ({"topology": {"name": "x", "model": MODEL, "pools": [POOL | {"replicas": 0}]}},
     "/topology/pools/0/replicas"),
    ({"topology": {"name": "x", "model": MODEL, "pools": [POOL]},
      "workerGroups": {"unified": GROUP | {"replicas": 0}}}, "/workerGroups/unified/replicas"),
    ({"topology": {"name": "x", "model": MODEL, "pools": [POOL]},
      "workerGroups": {"unified": GROUP | {"gpusPerPod": 0}}},
     "topology.pools[main] needs 1 GPU(s) per replica, but workerGroups.unified.gpusPerPod is 0"),
    ({"topology": {"name": "x", "model": MODEL, "router": {"policy": "least_loaded"}, "pools": [
        POOL | {"resources": {"cpus": 8, "gpus": 4}, "parallel": {"data": 4, "backend": "ray"}}]},
      "workerGroups": {"unified": GROUP | {"replicas": 3}}},
     "topology.pools[main] needs 4 GPUs across pods (parallel.backend ray), but "
     "workerGroups.unified has 3 (replicas x gpusPerPod)"),
    ({"topology": {"name": "x", "model": MODEL, "router": {"policy": "least_loaded"}, "pools": [
        POOL | {"resources": {"cpus": 8, "gpus": 4},
                "parallel": {"data": 2, "tensor": 2, "backend": "ray"}}]},
      "workerGroups": {"unified": GROUP | {"replicas": 4}}},
     "topology.pools[main] puts each rank's 2 GPU(s) on one pod (parallel.backend ray), but "
     "workerGroups.unified.gpusPerPod is 1"),
    ({"topology": {"name": "x", "model": MODEL, "pools": [POOL], "router": {"policy": "fastest"}}},
     "/topology/router/policy"),
    ({"topology": {"name": "x", "model": MODEL, "pools": [POOL], "gateway": {"colocate": True}}},
     "topology.gateway.colocate: this chart serves the gateway from the head pod"),
    ({"topology": {"name": "x", "model": MODEL, "pools": [POOL]}, "tenantKeys": {"a": ["plain"]}},
     "/tenantKeys/a/0"),
])
def test_bad_values_fail_with_a_readable_error(values, message) -> None:
    with pytest.raises(helm.HelmError) as error:
        render(values)
    assert message in str(error.value)


def _pod_templates(rayservice: dict[str, Any]) -> list[dict[str, Any]]:
    cluster = rayservice["spec"]["rayClusterConfig"]
    return [cluster["headGroupSpec"]["template"],
            *(group["template"] for group in cluster.get("workerGroupSpecs", []))]


def test_monitors_select_every_engine_pod_and_a_port_it_has() -> None:
    values = yaml.safe_load((CHART / "examples/llama3-8b-pd-h100.yaml").read_text())
    docs = {doc["kind"]: doc for doc in render(values)}
    pods = _pod_templates(docs["RayService"])
    pod_monitor = docs["PodMonitor"]["spec"]
    (expression,) = pod_monitor["selector"]["matchExpressions"]
    selected = [pod for pod in pods
                if pod["metadata"]["labels"][expression["key"]] in expression["values"]
                and pod_monitor["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()]
    assert len(selected) == len(pods) - 1  # every worker group, not the head
    for pod in selected:
        ports = {p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
        assert {e["port"] for e in pod_monitor["podMetricsEndpoints"]} <= ports
    service = docs["Service"]
    service_ports = {p["name"] for p in service["spec"]["ports"]}
    endpoints = docs["ServiceMonitor"]["spec"]["endpoints"]
    assert {e["port"] for e in endpoints} <= service_ports
    assert docs["ServiceMonitor"]["spec"]["selector"]["matchLabels"].items() <= \
        service["metadata"]["labels"].items()


def test_wide_ep_nodes_get_their_nics_and_memory_locking() -> None:
    """The wide expert-parallel example: each role a group of whole 8-GPU nodes with their RDMA
    NICs, IPC_LOCK for registering memory, and the NIC settings in the environment."""
    values = yaml.safe_load((CHART / "examples/deepseek-v3-wide-ep-h200.yaml").read_text())
    docs = {doc["kind"]: doc for doc in render(values)}
    groups = docs["RayService"]["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert {g["groupName"] for g in groups} == {"prefill", "decode"}
    for group in groups:
        (container,) = group["template"]["spec"]["containers"]
        for side in ("requests", "limits"):
            assert container["resources"][side]["rdma/ib"] == "8"
            assert container["resources"][side]["nvidia.com/gpu"] == 8
        assert container["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
        assert {"name": "NVSHMEM_IB_ENABLE_IBGDA", "value": "1"} in container["env"]
    topology = parse_topology(yaml.safe_load(docs["ConfigMap"]["data"]["topology.yaml"]))
    decode = topology.pool("decode")
    assert (decode.parallel.data, decode.parallel.expert, decode.parallel.backend) == \
        (16, True, "ray")
