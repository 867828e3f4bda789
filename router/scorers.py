"""Built-in filters and scorers. Each scorer returns one score in [0, 1] per candidate.

Formulas, for candidates c and request r (worked examples in each docstring):
  prefix         c.cached_tokens / r.prompt_tokens
  approx_prefix  c.approx_cached_tokens / r.prompt_tokens
  queue          (max_q - c.in_flight) / (max_q - min_q), 1 when all are equal
  kv_usage       1 - c.kv_usage
  ttft           min over candidates of estimated TTFT / c's estimated TTFT, where TTFT is
                 overhead + (queued prefill + in_flight * cost + uncached) / prefill tokens/s
  delay          the same ratio of TTFT + in_flight * uncached / prefill tokens/s: the request's
                 own wait plus what its prefill makes the replica's requests wait
  cache_room     new * (1 + min fill) / (1 + c.cache_fill), where new is the share of the
                 prompt no candidate holds
  adapter        1 where the request's LoRA adapter adds no wait on the replica (held, and
                 running or a batch slot free; or no adapter), else 0 (ttft and delay count
                 the wait itself: router/adapters.py)
"""

from __future__ import annotations

from collections.abc import Sequence

from router.plugins import Candidate, RouteRequest

DEFAULT_MAX_IN_FLIGHT = 64  # a replica's bound until it reports its engine's max_num_seqs


class PrefixScorer:
    """Share of the prompt the replica holds, from the engine-fed block map.

    Example: a 1,024-token prompt, replica a holds 768 leading tokens, b none -> [0.75, 0.0].
    """

    name = "prefix"

    def score(self, request: RouteRequest, candidates: Sequence[Candidate]) -> list[float]:
        total = request.prompt_tokens
        return [c.cached_tokens / total if total else 0.0 for c in candidates]


class ApproxPrefixScorer:
    """Share of the prompt this router recently sent to the replica (no engine events needed).

    Example: a 1,024-token prompt whose first 512 tokens went to b 10 s ago -> [0.0, 0.5].
    """

    name = "approx_prefix"

    def score(self, request: RouteRequest, candidates: Sequence[Candidate]) -> list[float]:
        total = request.prompt_tokens
        return [c.approx_cached_tokens / total if total else 0.0 for c in candidates]


class QueueScorer:
    """Fewer requests in flight is better, scaled between the least and the most loaded.

    Example: in flight [2, 6, 4] -> [1.0, 0.0, 0.5].
    """

    name = "queue"

    def score(self, request: RouteRequest, candidates: Sequence[Candidate]) -> list[float]:
        loads = [c.in_flight for c in candidates]
        low, high = min(loads, default=0), max(loads, default=0)
        if high == low:
            return [1.0] * len(candidates)
        return [(high - load) / (high - low) for load in loads]


class KVUsageScorer:
    """More free KV cache is better. Example: usage [0.9, 0.2] -> [0.1, 0.8]."""

    name = "kv_usage"

    def score(self, request: RouteRequest, candidates: Sequence[Candidate]) -> list[float]:
        return [1.0 - c.kv_usage for c in candidates]


class TTFTScorer:
    """Estimated time to first token (see Candidate.estimated_ttft_s), relative to the best.

    Example (in-flight cost 128 tokens, no overhead): a 2,048-token prompt at 4,000 tokens/s
    everywhere; a holds 1,536 tokens, has 3,000 queued and 2 in flight (0.942 s), b holds nothing
    and is idle (0.512 s) -> [0.544, 1.0]: the hot replica is busy enough that recomputing on b
    is faster.
    With only 1,000 queued on a (0.442 s) -> [1.0, 0.863]: affinity wins.
    """

    name = "ttft"

    def score(self, request: RouteRequest, candidates: Sequence[Candidate]) -> list[float]:
        estimates = [c.estimated_ttft_s(request) for c in candidates]
        best = min(estimates, default=0.0)
        return [best / estimate if estimate > 0 else 1.0 for estimate in estimates]


class DelayScorer:
    """The waiting the placement adds to everyone on the replica (see
    Candidate.estimated_delay_s), relative to the best. `ttft` scores what this request waits;
    this also counts what it makes the replica's running requests wait, so a long prompt that
    no replica holds goes where the fewest requests are decoding.

    Example (the estimates of Candidate.estimated_delay_s's example): a 0.698 s, b 2.688 s ->
    [1.0, 0.260]; `ttft` alone scores them [1.0, 0.691].
    """

    name = "delay"

    def score(self, request: RouteRequest, candidates: Sequence[Candidate]) -> list[float]:
        estimates = [c.estimated_delay_s(request) for c in candidates]
        best = min(estimates, default=0.0)
        return [best / estimate if estimate > 0 else 1.0 for estimate in estimates]


class CacheRoomScorer:
    """Where a new prefix costs the least future reuse: the replica whose prefix cache has the
    most free or cold room (lowest `cache_fill`: blocks held, stored recently and queued, over
    capacity). It counts as much as the prompt is new: a prompt held whole somewhere scores 0
    everywhere, so affinity and load alone decide where it goes.

    Example: fill [1.5, 0.5], nothing held anywhere -> room [(1 + 0.5) / (1 + 1.5), 1] =
    [0.6, 1.0]; the same with 75% of the prompt held on a -> 0.25 x room = [0.15, 0.25].
    """

    name = "cache_room"

    def score(self, request: RouteRequest, candidates: Sequence[Candidate]) -> list[float]:
        total = request.prompt_tokens
        held = max((max(c.cached_tokens, c.approx_cached_tokens) for c in candidates), default=0)
        new = 1.0 - min(1.0, held / total) if total else 0.0
        low = min((c.cache_fill for c in candidates), default=0.0)
        return [new * (1.0 + low) / (1.0 + c.cache_fill) for c in candidates]


class AdapterScorer:
    """Whether the request's LoRA adapter can run at once on the replica: 1 if the replica
    holds it and has a batch slot for it (or the request runs on the base model); 0 where it
    must be loaded first or wait for a slot.

    Example: adapter x; a holds it, b does not (load 0.02 s) -> [1.0, 0.0].
    """

    name = "adapter"

    def score(self, request: RouteRequest, candidates: Sequence[Candidate]) -> list[float]:
        return [0.0 if c.adapter_wait_s > 0 else 1.0 for c in candidates]


class AdapterSlotFilter:
    """Drops replicas where the request's LoRA adapter would wait for a batch slot (every slot
    runs another adapter there) while another replica can run it at once; keeps everyone when
    none can. Measured on two engines with max_loras 2 (benchmarks/lora.py): a request sent
    where the slots were taken waited for its first token a median 0.24 s, one with a slot
    0.04 s; a prefix held there saves far less than that, so no affinity may outweigh it.

    Example: slot waits [0.2, 0.0, 0.1] -> only the second remains; [0.2, 0.1] -> both remain.
    """

    name = "adapter_slot"

    def filter(self, request: RouteRequest, candidates: Sequence[Candidate]) -> list[Candidate]:
        if request.adapter is None:
            return list(candidates)
        kept = [c for c in candidates if c.adapter_slot_s <= 0]
        return kept or list(candidates)


class OverloadFilter:
    """Drops replicas with a full batch or more in flight, so no prefix, however hot, piles more
    onto a saturated replica; keeps everyone when all are saturated. A full batch is
    `max_in_flight` where set, else each replica's own `batch_slots` (its engine's
    max_num_seqs), else `DEFAULT_MAX_IN_FLIGHT` until the replica has reported it.

    A fixed bound below what the engine batches turns a replica away while it has room: at 64
    in flight (a share of the 1,024 an H100 engine batches), the replica holding a
    conversation's prefix was skipped and each turn recomputed elsewhere
    (benchmarks/simulated/routing_at_scale.py).

    Example (max 8): in flight [8, 3] -> only the second remains; [8, 9] -> both remain.
    No max, slots [256, 8]: in flight [100, 8] -> only the first remains.
    """

    name = "overload"

    def __init__(self, max_in_flight: int | None = None) -> None:
        self.max_in_flight = max_in_flight

    def limit(self, batch_slots: int) -> int:
        """The bound of a replica whose engine runs `batch_slots` a batch (0: not known)."""
        return self.max_in_flight or batch_slots or DEFAULT_MAX_IN_FLIGHT

    def filter(self, request: RouteRequest, candidates: Sequence[Candidate]) -> list[Candidate]:
        kept = [c for c in candidates if c.in_flight < self.limit(c.batch_slots)]
        return kept or list(candidates)


class TTFTTargetFilter:
    """Drops replicas whose estimated time to first token (Candidate.estimated_ttft_s) exceeds
    the pool's TTFT target while another replica's meets it; keeps everyone when none does.

    Affinity scores are bounded (a held prefix adds at most 1), and so is the TTFT score (a
    replica 4x slower than the best still scores 0.25), so without this a popular prefix keeps
    its holder ahead however long its queue grows. Simulated at 16 H100 replicas, the most
    popular of 16 system prompts (30% of the conversations) kept its holder chosen at estimates
    up to 4x an idle replica's, and the goodput at a TTFT target fell to a tenth of Dynamo's
    router's (benchmarks/simulated/routing_at_scale.py, sessions). Past the target, recomputing the
    prefix elsewhere is the cheaper miss for the request.

    Not always for the pool: near its capacity each recompute is work added and blocks evicted
    elsewhere (router/README.md, "What the target costs a saturated pool").

    Example (target 0.5 s): estimates [0.54, 0.13] -> only the second remains; [0.6, 0.7] ->
    both remain.
    """

    name = "ttft_target"

    def __init__(self, target_s: float) -> None:
        self.target_s = target_s

    def filter(self, request: RouteRequest, candidates: Sequence[Candidate]) -> list[Candidate]:
        kept = [c for c in candidates if c.estimated_ttft_s(request) <= self.target_s]
        return kept or list(candidates)


SCORERS = {cls.name: cls for cls in (PrefixScorer, ApproxPrefixScorer, QueueScorer,
                                     KVUsageScorer, TTFTScorer, CacheRoomScorer, DelayScorer,
                                     AdapterScorer)}
