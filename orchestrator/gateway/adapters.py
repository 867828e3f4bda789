"""The models and LoRA adapters one gateway serves, as a tenant sees them.

The topology declares the model and its adapters; adapters loaded at run time are entries of the
replica registry (pools.registry.AdapterRecord), which every ingress replica reads about once a
second, so all of them serve the same set. A private adapter (`tenants`) does not exist for any
other tenant: its name gets the same 404 as a name nobody loaded, and `/v1/models` leaves it out.
"""

from __future__ import annotations

import json
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
    """The model and its adapters (declared, and loaded at run time). One per ingress replica,
    on its event loop; `update` replaces the run-time set with the registry's."""

    def __init__(self, model: ModelSpec, tenants: set[str] | None = None) -> None:
        self.model = model
        self._tenants = tenants or set()
        self._declared = {a.name: AdapterRecord(a.name, a.resolved_path, model.name, a.tenants)
                          for a in model.adapters}
        self._loaded: dict[str, AdapterRecord] = {}
        self._refs: dict[str, AdapterRef] = {}
        self._reindex()

    @property
    def enabled(self) -> bool:
        """Whether the model's engines run adapters at all (model.lora)."""
        return self.model.lora is not None

    def declared(self, name: str) -> bool:
        return name in self._declared

    def records(self) -> list[AdapterRecord]:
        """Every adapter served now, declared first."""
        return [*self._declared.values(), *self._loaded.values()]

    def update(self, loaded: list[AdapterRecord]) -> None:
        """The adapters loaded at run time, as the registry lists them now (a name declared in
        the topology keeps its declared entry)."""
        self._loaded = {r.name: r for r in loaded if r.name not in self._declared
                        and r.parent == self.model.name}
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

    def resolve(self, tenant: TenantSpec, model: str) -> AdapterRef | None:
        """What a request's `model` names for this tenant: None for the base model, or the
        adapter. 404 for a name that is neither, or an adapter private to other tenants."""
        if model == self.model.name:
            return None
        ref = self._refs.get(model)
        if ref is None or not self._visible(tenant, self._records[model]):
            raise not_found(model)
        return ref

    def _visible(self, tenant: TenantSpec, record: AdapterRecord) -> bool:
        return record.tenants is None or tenant.name in record.tenants

    def cards(self, tenant: TenantSpec, created: int) -> list[dict[str, Any]]:
        """`/v1/models` for this tenant: the model, then each adapter it may see and use, with
        its `parent`, as vLLM lists them."""
        model = self.model
        allowed = tenant.models
        cards = [{"id": model.name, "object": "model", "created": created, "owned_by": "tokenfab",
                  "root": model.path, "parent": None, "max_model_len": model.max_model_len}]
        for record in self._records.values():
            if self._visible(tenant, record) and (allowed is None or record.name in allowed):
                cards.append({"id": record.name, "object": "model", "created": created,
                              "owned_by": "tokenfab", "root": record.path,
                              "parent": record.parent, "max_model_len": model.max_model_len})
        if allowed is not None and model.name not in allowed:
            cards.pop(0)
        return cards

    def check_new(self, body: Any) -> AdapterRecord:
        """The record of an adapter an admin asks to load ({"name", "path", "tenants"}): 400
        naming the field when it cannot be served, 409 when the name is taken. Reads the
        adapter's config from `path` (on the gateway's node; the engines' nodes must have the
        same files there)."""
        if not self.enabled:
            raise GatewayError(400, f"model {self.model.name} runs no adapters: its topology "
                               "sets no model.lora", "model", code="lora_disabled")
        if not isinstance(body, dict):
            raise GatewayError(400, "expected a JSON object {name, path, tenants}")
        if unknown := sorted(body.keys() - {"name", "path", "tenants"}):
            raise GatewayError(400, f"{unknown[0]}: unknown field", unknown[0])
        name, path, tenants = body.get("name"), body.get("path"), body.get("tenants")
        if not isinstance(name, str) or not _valid_name(name):
            raise GatewayError(400, f"name: expected a name matching {ADAPTER_NAME}", "name")
        if name == self.model.name or name in self._declared:
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
        self._check_files(Path(path))
        return AdapterRecord(name, path, self.model.name, tenants)

    def _check_files(self, path: Path) -> None:
        try:
            config = json.loads((path / "adapter_config.json").read_text())
        except OSError:
            raise GatewayError(400, f"path: no adapter at {path} (adapter_config.json is "
                               "missing or unreadable)", "path", code="adapter_not_found"
                               ) from None
        except ValueError as exc:
            raise GatewayError(400, f"path: {path}/adapter_config.json is not JSON: {exc}",
                               "path") from None
        rank, limit = config.get("r"), self.model.lora.max_rank
        if not isinstance(rank, int) or rank > limit:
            raise GatewayError(400, f"path: the adapter's rank {rank!r} exceeds "
                               f"model.lora.max_rank ({limit})", "path")


def _valid_name(name: str) -> bool:
    import re

    return re.fullmatch(ADAPTER_NAME, name) is not None
