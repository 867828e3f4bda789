"""A model's LoRA adapters (the `model.lora` section; see orchestrator.config for the whole
document): the engines' adapter slots, and the adapters declared with the topology. Adapters
loaded at run time (`tokenfab adapter load`) follow the same rules."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from orchestrator.strict import Strict as _Strict

ADAPTER_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
# The ranks vLLM 0.32 accepts for max_lora_rank (vllm.config.lora.MaxLoRARanks)
LoraRank = Literal[1, 8, 16, 32, 64, 128, 256, 320, 512]


def resolved_path(path: str) -> str:
    """A local path made absolute (`~` expanded), a hub id as it is. Engines hash an adapter's
    path into its KV blocks' hashes, so every replica and every gateway must use one spelling."""
    expanded = Path(path).expanduser()
    is_local = path.startswith(("/", ".", "~")) or expanded.exists()
    return str(expanded.resolve()) if is_local else path


class AdapterSpec(_Strict):
    """A LoRA adapter of the model: clients name it in `model`."""

    name: str = Field(pattern=ADAPTER_NAME, description="Name clients use in the `model` field.")
    path: str = Field(min_length=1, description="Directory of the adapter (PEFT format: "
                      "adapter_config.json and its weights), on every node. `~` is expanded.")
    generate: int | None = Field(
        None, ge=0, description="Generate the tiny model's adapter number N at `path` if it is "
        "missing (what `tokenfab model tiny --lora` writes as lora-N).")
    tenants: list[str] | None = Field(
        None, description="Private to these tenants: to every other tenant it does not exist "
        "(404, as an unknown name). null: every tenant whose `models` allows it.")

    @property
    def resolved_path(self) -> str:
        return resolved_path(self.path)


class LoraSpec(_Strict):
    """The engines' LoRA support (vLLM's own): every engine of the model can run adapters."""

    max_loras: int = Field(
        2, ge=1, le=64, description="Adapters one engine runs in a batch at once (vLLM "
        "max_loras): a request for another waits until one of them has no request running.")
    max_cpu_loras: int | None = Field(
        None, ge=1, description="Adapters one engine keeps loaded (vLLM max_cpu_loras), the "
        "least recently used evicted first; null: max_loras. A request for an adapter not "
        "loaded loads it first (the router counts that cost).")
    max_rank: LoraRank = Field(16, description="Largest adapter rank the engines accept "
                               "(vLLM max_lora_rank); memory is reserved for it.")
    adapters: list[AdapterSpec] = Field(
        default_factory=list, description="Adapters served from the start; more can be loaded "
        "and unloaded at run time (tokenfab adapter load/unload).")

    @model_validator(mode="after")
    def _cache_holds_a_batch(self) -> LoraSpec:
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras "
                             f"({self.max_loras}): a batch's adapters are all loaded")
        names = [adapter.name for adapter in self.adapters]
        if twice := sorted({name for name in names if names.count(name) > 1}):
            raise ValueError(f"adapters: {twice[0]!r} is declared twice")
        return self

    @property
    def resident(self) -> int:
        """How many adapters an engine keeps loaded."""
        return self.max_cpu_loras or self.max_loras
