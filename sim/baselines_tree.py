"""sglang-router's approximate radix tree (`src/policies/tree.rs`, 0.3.2; vllm-router 0.1.17's
`src/tree.rs` is the same file plus a per-tenant match), over block hashes instead of characters.

One tree holds every worker ("tenant"). A node is a run of keys and the tenants that were sent
it, each with the epoch of its last access; a tenant on a node is on all its ancestors. The
source's units are characters; here a key is one block hash, so lengths and the per-tenant size
count blocks (the routers turn them into tokens). Nothing here is thread-safe: the simulator's
loop is its one owner.

Where the source leaves an order to a hash map (the tenant a node yields when its cached one is
gone, the tenants of `leaf_of`, equal timestamps in the eviction heap), this takes insertion
order.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

Tenant = str  # a worker (its URL in the source)
EMPTY = "empty"  # the tenant the source reports for a node that has none


class _Node:
    __slots__ = ("children", "text", "tenants", "parent", "last_tenant")

    def __init__(self, text: tuple[int, ...], parent: _Node | None,
                 last_tenant: Tenant | None) -> None:
        self.children: dict[int, _Node] = {}  # by first key
        self.text = text
        self.tenants: dict[Tenant, int] = {}  # tenant -> epoch of last access (0: passed through)
        self.parent = parent
        self.last_tenant = last_tenant  # the source's O(1) cache; set at creation, never after


class ApproxTree:
    """The tree. `size[tenant]` is its blocks summed over the nodes that hold it."""

    def __init__(self) -> None:
        self.root = _Node((), None, None)
        self.size: dict[Tenant, int] = {}
        self._epoch = -1  # the source's process-wide EPOCH_COUNTER (an int: the tree copies)

    def insert(self, keys: Sequence[int], tenant: Tenant) -> None:
        """Add `keys` for `tenant`, splitting the node where they diverge. The node it ends on gets
        a new epoch; the nodes it passes through keep theirs (0 for a tenant new to them)."""
        self.root.tenants.setdefault(tenant, 0)
        self.size.setdefault(tenant, 0)
        node, i, n = self.root, 0, len(keys)
        while i < n:
            child = node.children.get(keys[i])
            if child is None:
                leaf = node.children[keys[i]] = _Node(tuple(keys[i:]), node, tenant)
                leaf.tenants[tenant] = self._next_epoch()
                self.size[tenant] += n - i
                return
            shared = _shared(keys, i, child.text)
            if shared < len(child.text):  # split: the shared head becomes the parent
                head = _Node(child.text[:shared], node, child.last_tenant)
                head.tenants = dict(child.tenants)
                child.text, child.parent = child.text[shared:], head
                head.children[child.text[0]] = child
                node.children[keys[i]] = child = head
            if tenant not in child.tenants:
                self.size[tenant] += len(child.text)
                child.tenants[tenant] = 0
            node, i = child, i + shared
        node.tenants[tenant] = self._next_epoch()

    def _next_epoch(self) -> int:
        self._epoch += 1
        return self._epoch

    def prefix_match(self, keys: Sequence[int]) -> tuple[Tenant, int]:
        """sglang's `prefix_match_with_counts`: the keys matched by any tenant, and the cached
        tenant of the deepest node reached (its creator, else the first tenant it holds). One
        match in 8 (by epoch) refreshes that tenant's epoch there."""
        node, i, matched, n = self.root, 0, 0, len(keys)
        while i < n:
            child = node.children.get(keys[i])
            if child is None:
                break
            shared = _shared(keys, i, child.text)
            matched, node = matched + shared, child
            if shared < len(child.text):
                break
            i += shared
        tenant = node.last_tenant
        if tenant is None or tenant not in node.tenants:
            tenant = node.last_tenant = next(iter(node.tenants), EMPTY)
        epoch = self._next_epoch()
        if epoch & 0x7 == 0:
            node.tenants[tenant] = epoch
        return tenant, matched

    def match_depths(self, keys: Sequence[int]) -> dict[Tenant, int]:
        """vllm-router's `prefix_match_tenant_char_count` for every tenant at once: the keys each
        tenant matches, walking only nodes it holds; no epoch changes. The path of `keys` is
        unique and tenants nest along it, so one walk serves all."""
        path: list[tuple[_Node, int]] = []
        node, i, matched, n = self.root, 0, 0, len(keys)
        while i < n:
            child = node.children.get(keys[i])
            if child is None:
                break
            shared = _shared(keys, i, child.text)
            matched, node = matched + shared, child
            path.append((child, matched))
            if shared < len(child.text):
                break
            i += shared
        depths: dict[Tenant, int] = {}
        for node, depth in reversed(path):
            for tenant in node.tenants:
                depths.setdefault(tenant, depth)
        return depths

    def evict(self, max_size: int) -> None:
        """`evict_tenant_by_size`: while a tenant holds more than `max_size` blocks, drop it from
        its least recently used leaf (a node none of whose children it holds); a node left with
        no tenant and no child goes, and a parent left a leaf joins the queue."""
        heap: list[tuple[int, int, Tenant, _Node]] = []
        order = itertools.count()
        stack = [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            for tenant in _leaf_of(node):
                heapq.heappush(heap, (node.tenants[tenant], next(order), tenant, node))
        while heap:
            _, _, tenant, node = heapq.heappop(heap)
            if self.size.get(tenant, max_size + 1) <= max_size:
                continue
            if tenant not in node.tenants or _held_below(node, tenant):
                continue  # no longer its leaf
            if tenant in self.size:
                self.size[tenant] = max(0, self.size[tenant] - len(node.text))
            del node.tenants[tenant]
            parent = node.parent
            if parent is None:
                continue
            if not node.children and not node.tenants and node.text:
                parent.children.pop(node.text[0], None)
            if tenant in parent.tenants and not _held_below(parent, tenant):
                heapq.heappush(heap, (parent.tenants[tenant], next(order), tenant, parent))

    def remove_tenant(self, tenant: Tenant) -> None:
        """Drop `tenant` everywhere, leaves first (a worker removed, or found stale)."""
        queue: list[_Node] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if tenant in node.tenants and not _held_below(node, tenant):
                queue.append(node)
        for node in queue:  # grows as parents become leaves
            node.tenants.pop(tenant, None)
            parent = node.parent
            if parent is None:
                continue
            if not node.children and not node.tenants and node.text:
                parent.children.pop(node.text[0], None)
            if tenant in parent.tenants and not _held_below(parent, tenant):
                queue.append(parent)
        self.size.pop(tenant, None)


def _shared(keys: Sequence[int], start: int, text: tuple[int, ...]) -> int:
    n = min(len(text), len(keys) - start)
    k = 0
    while k < n and keys[start + k] == text[k]:
        k += 1
    return k


def _held_below(node: _Node, tenant: Tenant) -> bool:
    return any(tenant in child.tenants for child in node.children.values())


def _leaf_of(node: _Node) -> list[Tenant]:
    return [t for t in node.tenants if not _held_below(node, t)]
