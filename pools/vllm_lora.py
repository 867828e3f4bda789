"""A vLLM engine's LoRA adapters, through vLLM's own serving layer: each registered once (its
`load_lora_adapter`, which loads and validates it), loaded again after an eviction (`add_lora`),
each load timed and mirrored in `pools.adapters.AdapterSlots`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from channel.frames import AdapterRef
from pools.adapters import AdapterSlots


class VllmLora:
    """One engine's adapters. `attach` gives it the engine once started; runs on the engine's
    event loop. `raise_if_dead` turns an error of a dead engine into EngineDeadError."""

    def __init__(self, capacity: int, raise_if_dead: Callable[[Exception], None]) -> None:
        self.slots = AdapterSlots(capacity, self._load)
        self._raise_if_dead = raise_if_dead
        self._llm: Any = None
        self._models: Any = None  # vLLM's OpenAIServingModels: the adapters requests can name
        self._error_type: type = type(None)
        self._registering: dict[str, asyncio.Future[Any]] = {}  # adapters being registered, by name

    def attach(self, llm: Any, models: Any, error_type: type) -> None:
        """The started engine, its serving layer's models and vLLM's error reply type."""
        self._llm, self._models, self._error_type = llm, models, error_type

    async def use(self, adapter: AdapterRef) -> Any:
        """Register the adapter with vLLM's serving layer (which maps the body's `model` to its
        LoRARequest) under this path, and load it into the engine where it is not loaded. vLLM's
        error reply when it cannot (None: it can run)."""
        known = self._models.lora_requests.get(adapter.name)
        if known is None or known.lora_path != adapter.path:
            # one registration per adapter at a time: vLLM refuses a second as a duplicate
            task = self._registering.get(adapter.name)
            if task is None:
                task = asyncio.ensure_future(self._register(adapter, replace=known is not None))
                self._registering[adapter.name] = task
                task.add_done_callback(lambda _: self._registering.pop(adapter.name, None))
            return await asyncio.shield(task)
        try:
            await self.slots.use(adapter.name)
        except Exception as exc:  # noqa: BLE001 - vLLM's error for a load that failed
            self._raise_if_dead(exc)
            from vllm.entrypoints.serve.exception_handling.error_response import (
                create_error_response)

            return create_error_response(exc)
        return None

    async def _register(self, adapter: AdapterRef, replace: bool) -> Any:
        """vLLM's own dynamic loading: registers the adapter and loads it into the engine (which
        validates it); timed, as a load. vLLM's error reply, or None."""
        from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest

        started = time.monotonic()
        result = await self._models.load_lora_adapter(LoadLoRAAdapterRequest(
            lora_name=adapter.name, lora_path=adapter.path, load_inplace=replace))
        if isinstance(result, self._error_type):
            return result
        self.slots.loaded(adapter.name, time.monotonic() - started)
        return None

    async def _load(self, name: str) -> None:
        """Load a registered adapter into the engine (vLLM evicts its least recently used)."""
        await self._llm.add_lora(self._models.lora_requests[name])

    async def loaded(self) -> list[str]:
        """The adapters the engine holds now, by name (a round trip to the engine)."""
        if self._llm is None or self._models is None:
            return []
        ids = await self._llm.list_loras()
        return [name for name, request in self._models.lora_requests.items()
                if request.lora_int_id in ids]
