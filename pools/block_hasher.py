"""vLLM's own prefix-cache block hashing, for the router (implements router.hashing.BlockHasher)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from router.events import EngineBlockHash


class VllmBlockHasher:
    """Same hash function, seed, chaining and extra keys as the engine's KV cache manager.

    The engines must run with the same `prefix_caching_hash_algo` (default sha256, whose seed is
    fixed across processes) and block size; the block size is in every BlockStored event.
    """

    def __init__(self, block_size: int, hash_algo: str = "sha256") -> None:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core import kv_cache_utils

        self.block_size = block_size
        self._hash_fn = get_hash_fn_by_name(hash_algo)
        self._utils = kv_cache_utils
        kv_cache_utils.init_none_hash(self._hash_fn)

    def block_hashes(self, token_ids: Sequence[int], cache_salt: str | None = None,
                     lora: tuple[str, str] | None = None) -> list[EngineBlockHash]:
        hashes: list[EngineBlockHash] = []
        parent = None
        for start in range(0, len(token_ids) - self.block_size + 1, self.block_size):
            extra = self._extra_keys(start, cache_salt, lora)
            parent = self._utils.hash_block_tokens(
                self._hash_fn, parent, token_ids[start:start + self.block_size], extra)
            hashes.append(self._utils.maybe_convert_block_hash(parent))
        return hashes

    @staticmethod
    def _extra_keys(start: int, cache_salt: str | None,
                    lora: tuple[str, str] | None) -> tuple[Any, ...] | None:
        # Order as in vLLM's generate_block_hash_extra_keys: LoRA, (multi-modal), salt.
        keys: list[Any] = [("lora", *lora)] if lora else []
        if start == 0 and cache_salt:
            keys.append(("cache_salt", cache_salt))
        return tuple(keys) or None
