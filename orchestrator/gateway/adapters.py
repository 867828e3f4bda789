"""The models and LoRA adapters one gateway serves, as a tenant sees them.

The topology declares the models and their adapters; adapters loaded at run time are entries of the
replica registry (pools.registry.AdapterRecord), which every ingress replica reads about once a
second, so all of them serve the same set. A private adapter (`tenants`) does not exist for any
other tenant: its name gets the same 404 as a name nobody loaded, and `/v1/models` leaves it out.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from channel.frames import AdapterRef
from orchestrator.adapter_config import ADAPTER_NAME, resolved_path
from orchestrator.config import ModelSpec
from orchestrator.gateway.errors import GatewayError
from orchestrator.tenant_config import TenantSpec
from pools.registry import AdapterRecord


def not_found(model: str) -> GatewayError:
    return GatewayError(404, f"The model `{model}` does not exist.", "model",
                        code="model_not_found")


class AdapterCatalog:
    """The models and their adapters (declared, and loaded at run time). One per ingress
    replica, on its event loop; `update` replaces the run-time set with the registry's."""

    def __init__(self, models: list[ModelSpec], tenants: set[str] | None = None) -> None:
        self.models = {model.name: model for model in models}
        self._tenants = tenants or set()
        self._declared = {a.name: AdapterRecord(a.name, a.resolved_path, model.name, a.tenants)
                          for model in models for a in model.adapters}
        self._loaded: dict[str, AdapterRecord] = {}
        self._refs: dict[str, AdapterRef] = {}
        self._reindex()

    @property
    def enabled(self) -> bool:
        """Whether any model's engines run adapters at all (its lora section)."""
        return any(model.lora is not None for model in self.models.values())

    def declared(self, name: str) -> bool:
        return name in self._declared

    def records(self) -> list[AdapterRecord]:
        """Every adapter served now, declared first."""
        return [*self._declared.values(), *self._loaded.values()]

    def update(self, loaded: list[AdapterRecord]) -> None:
        """The adapters loaded at run time, as the registry lists them now (a name declared in
        the topology keeps its declared entry)."""
        self._loaded = {r.name: r for r in loaded if r.name not in self._declared
                        and r.name not in self.models and self._runs_adapters(r.parent)}
        self._reindex()

    def add(self, record: AdapterRecord) -> None:
        """An adapter this replica's admin route just loaded (the others read the registry)."""
        self._loaded[record.name] = record
        self._reindex()

    def remove(self, name: str) -> None:
        self._loaded.pop(name, None)
        self._reindex()

    def _reindex(self) -> None:
        self._records = {**self._loaded, **self._declared}
        self._refs = {name: AdapterRef(name, r.path) for name, r in self._records.items()}

    def _runs_adapters(self, model: str) -> bool:
        spec = self.models.get(model)
        return spec is not None and spec.lora is not None

    def resolve(self, tenant: TenantSpec, model: str) -> tuple[str, AdapterRef | None]:
        """What a request's `model` names for this tenant: the model that serves it, and the
        adapter (None for a model itself). 404 for a name that is neither, or an adapter
        private to other tenants."""
        if model in self.models:
            return model, None
        ref = self._refs.get(model)
        if ref is None or not self._visible(tenant, self._records[model]):
            raise not_found(model)
        return self._records[model].parent, ref

    def _visible(self, tenant: TenantSpec, record: AdapterRecord) -> bool:
        return record.tenants is None or tenant.name in record.tenants

    def cards(self, tenant: TenantSpec, created: int) -> list[dict[str, Any]]:
        """`/v1/models` for this tenant: the models, then each adapter it may see and use, with
        its `parent`, as vLLM lists them."""
        allowed = tenant.models
        cards = [{"id": model.name, "object": "model", "created": created, "owned_by": "tokenfab",
                  "root": model.path, "parent": None, "max_model_len": model.max_model_len}
                 for model in self.models.values() if allowed is None or model.name in allowed]
        for record in self._records.values():
            if self._visible(tenant, record) and (allowed is None or record.name in allowed):
                cards.append({"id": record.name, "object": "model", "created": created,
                              "owned_by": "tokenfab", "root": record.path,
                              "parent": record.parent,
                              "max_model_len": self.models[record.parent].max_model_len})
        return cards

    def check_new(self, body: Any) -> AdapterRecord:
        """The record of an adapter an admin asks to load ({"name", "path", "model",
        "tenants"}; `model`, the parent, may be left out where one model runs adapters): 400
        naming the field when it cannot be served, 409 when the name is taken. Reads the
        adapter's config from `path` (on the gateway's node; the engines' nodes must have the
        same files there)."""
        if not isinstance(body, dict):
            raise GatewayError(400, "expected a JSON object {name, path, model, tenants}")
        if unknown := sorted(body.keys() - {"name", "path", "model", "tenants"}):
            raise GatewayError(400, f"{unknown[0]}: unknown field", unknown[0])
        parent = self._parent(body.get("model"))
        name, path, tenants = body.get("name"), body.get("path"), body.get("tenants")
        if not isinstance(name, str) or re.fullmatch(ADAPTER_NAME, name) is None:
            raise GatewayError(400, f"name: expected a name matching {ADAPTER_NAME}", "name")
        if name in self.models or name in self._declared:
            raise GatewayError(409, f"name: {name!r} is declared in the topology", "name",
                               code="adapter_exists")
        if not isinstance(path, str) or not path:
            raise GatewayError(400, "path: expected the adapter's directory", "path")
        if tenants is not None and (not isinstance(tenants, list) or not all(
                isinstance(t, str) for t in tenants)):
            raise GatewayError(400, "tenants: expected a list of tenant names, or null",
                               "tenants")
        if unknown := sorted(set(tenants or ()) - self._tenants):
            raise GatewayError(400, f"tenants: no tenant {unknown[0]!r}", "tenants")
        path = resolved_path(path)
        self._check_files(Path(path), self.models[parent])
        return AdapterRecord(name, path, parent, tenants)

    def _parent(self, model: Any) -> str:
        """The model an adapter to load adapts: the one named, or the only one with LoRA."""
        running = sorted(name for name in self.models if self._runs_adapters(name))
        if model is None and len(running) == 1:
            return running[0]
        if not isinstance(model, str):  # None too
            raise GatewayError(400, f"model: name the model the adapter adapts, one of "
                               f"{running}", "model")
        if not self._runs_adapters(model):
            raise GatewayError(400, f"model: {model!r} runs no adapters (models with a lora "
                               f"section: {running})", "model", code="lora_disabled")
        return model

    def _check_files(self, path: Path, model: ModelSpec) -> None:
        try:
            config = json.loads((path / "adapter_config.json").read_text())
        except OSError:
            raise GatewayError(400, f"path: no adapter at {path} (adapter_config.json is "
                               "missing or unreadable)", "path", code="adapter_not_found"
                               ) from None
        except ValueError as exc:
            raise GatewayError(400, f"path: {path}/adapter_config.json is not JSON: {exc}",
                               "path") from None
        assert model.lora is not None  # _parent names only a model with a lora section
        rank, limit = config.get("r"), model.lora.max_rank
        if not isinstance(rank, int) or rank > limit:
            raise GatewayError(400, f"path: the adapter's rank {rank!r} exceeds "
                               f"model.lora.max_rank ({limit})", "path")
