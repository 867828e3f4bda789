"""The JSON Schema of the Helm chart's values (deploy/helm/tokenfab/values.schema.json).

`topology` is checked with the topology files' own schema, so Helm rejects a bad topology with
the same field names `tokenfab validate` uses; the rest describes the Kubernetes side.
`tokenfab chart-schema` prints it; a test keeps the committed file equal to it.
"""

from __future__ import annotations

from typing import Any

from orchestrator.config import topology_schema

_QUANTITY = {"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?(m|[KMGTPE]i?)?$"}
_TOLERATIONS = {"type": "array", "items": {"type": "object"}}
_NODE_SELECTOR = {"type": "object", "additionalProperties": {"type": "string"}}

WORKER_GROUP = {
    "type": "object",
    "description": "Ray worker pods for the pools of one role.",
    "required": ["replicas", "minReplicas", "maxReplicas", "gpusPerPod", "cpu", "memory"],
    "additionalProperties": False,
    "properties": {
        "replicas": {"type": "integer", "minimum": 1, "description": "Pods at install time."},
        "minReplicas": {"type": "integer", "minimum": 0},
        "maxReplicas": {"type": "integer", "minimum": 1},
        "gpusPerPod": {"type": "integer", "minimum": 0, "description": "nvidia.com/gpu per pod."},
        "cpu": _QUANTITY,
        "memory": _QUANTITY,
        "shmSize": _QUANTITY,
        "nodeSelector": _NODE_SELECTOR,
        "tolerations": _TOLERATIONS,
        "extraResources": {
            "type": "object", "additionalProperties": {"type": ["integer", "string"]},
            "description": "More device resources per pod, requested and limited alike: RDMA "
                           "NICs for NIXL and DeepEP, e.g. {rdma/ib: 8} from an RDMA device "
                           "plugin."},
        "env": {
            "type": "array", "description": "More environment of the Ray worker container "
            "(NCCL, NVSHMEM or UCX settings for the NICs).",
            "items": {"type": "object", "required": ["name", "value"],
                      "additionalProperties": False,
                      "properties": {"name": {"type": "string", "minLength": 1},
                                     "value": {"type": "string"}}}},
        "capabilities": {
            "type": "array", "items": {"enum": ["IPC_LOCK", "SYS_RESOURCE"]},
            "description": "Linux capabilities the worker container adds: IPC_LOCK lets RDMA "
                           "register (pin) GPU and host memory."},
    },
}


def values_schema() -> dict[str, Any]:
    topology = topology_schema()
    defs = topology.pop("$defs")
    defs["Topology"] = topology
    defs["WorkerGroup"] = WORKER_GROUP
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "tokenfab Helm values",
        "type": "object",
        "required": ["image", "topology", "head", "workerGroups", "service"],
        "additionalProperties": False,
        "properties": {
            "image": {"type": "object", "required": ["repository", "tag"],
                      "additionalProperties": False,
                      "properties": {"repository": {"type": "string", "minLength": 1},
                                     "tag": {"type": "string", "minLength": 1},
                                     "pullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]}}},
            "imagePullSecrets": {"type": "array", "items": {"type": "object"}},
            "topology": {"$ref": "#/$defs/Topology"},
            "head": {"type": "object", "additionalProperties": False,
                     "properties": {"cpu": _QUANTITY, "memory": _QUANTITY,
                                    "rayStartParams": {"type": "object",
                                                       "additionalProperties": {"type": "string"}},
                                    "nodeSelector": _NODE_SELECTOR, "tolerations": _TOLERATIONS}},
            "workerGroups": {"type": "object", "additionalProperties": False,
                             "properties": {role: {"$ref": "#/$defs/WorkerGroup"}
                                            for role in ("unified", "prefill", "decode")}},
            "service": {"type": "object", "additionalProperties": False,
                        "properties": {"type": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"]},
                                       "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                                       "annotations": {"type": "object"}}},
            "tenantKeys": {"type": "object", "description": "API-key digests (sha256:<hex>, "
                           "`tokenfab hash-key`), by tenant; mounted as auth.key_file.",
                           "additionalProperties": {"type": "array", "minItems": 1, "items": {
                               "type": "string", "pattern": "^sha256:[0-9a-f]{64}$"}}},
            "adminKeys": {"type": "array", "description": "Admin key digests (sha256:<hex>); "
                          "mounted as auth.admin_key_file. With auth on, /metrics and /tokenfab/* "
                          "answer only these keys.",
                          "items": {"type": "string", "pattern": "^sha256:[0-9a-f]{64}$"}},
            "saltKeySecret": {"type": "object", "additionalProperties": False,
                              "description": "An existing Secret holding the key (32 bytes or "
                              "more) that derives tenants' cache salts; mounted as "
                              "auth.salt_key_file. Empty name: a random key kept in Ray's GCS.",
                              "properties": {"name": {"type": "string"},
                                             "key": {"type": "string"}}},
            "hfTokenSecret": {"type": "string"},
            "adapters": {"type": "object", "additionalProperties": False,
                         "description": "LoRA adapters: a Kubernetes volume mounted read-only "
                         "at mountPath in the head (the gateway reads an adapter's config when "
                         "it is loaded) and in every worker (the engines load its weights); "
                         "adapter paths of the topology and of `tokenfab adapter load` point "
                         "under it. An empty volume: nothing is mounted.",
                         "properties": {"mountPath": {"type": "string", "pattern": "^/"},
                                        "volume": {"type": "object"}}},
            "networkPolicy": {"type": "object", "additionalProperties": False,
                              "description": "Ingress rules for the release's pods: the gateway "
                              "port open, the dashboard only to the KubeRay operator.",
                              "properties": {"enabled": {"type": "boolean"},
                                             **{name: {"type": "array",
                                                       "items": {"type": "object"}}
                                                for name in ("gatewayFrom", "operatorFrom",
                                                             "dashboardFrom", "metricsFrom")}}},
            "serviceMonitor": {"type": "object", "additionalProperties": False,
                               "properties": {"enabled": {"type": "boolean"},
                                              "interval": {"type": "string"},
                                              "labels": {"type": "object"},
                                              "adminKeySecret": {
                                                  "type": "object", "additionalProperties": False,
                                                  "description": "An existing Secret holding an "
                                                  "admin key in clear, which Prometheus sends; "
                                                  "needed when auth is on.",
                                                  "properties": {"name": {"type": "string"},
                                                                 "key": {"type": "string"}}}}},
        },
        "$defs": defs,
    }
