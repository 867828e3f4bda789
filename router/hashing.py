"""What the router needs to hash a request's tokens the way its engines do.

Engines publish block hashes in their KV events; the router computes the same hashes for a new
request and looks them up in the block map. The implementation lives with the engine adapter
(pools/block_hasher.py), so the router never imports vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from router.events import EngineBlockHash


class BlockHasher(Protocol):
    """Hashes full blocks of `block_size` tokens, chained from the first; a partial last block
    is not hashed (engines neither cache nor publish it). Pure and thread-safe."""

    block_size: int

    def block_hashes(self, token_ids: Sequence[int], cache_salt: str | None = None,
                     lora: tuple[str, str] | None = None) -> list[EngineBlockHash]:
        """One hash per full block. `cache_salt` and `lora` (name, path) enter the hash exactly
        where the engine puts them, so a salted request never matches an unsalted block."""
        ...
