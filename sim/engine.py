"""A simulated engine: vLLM v1's scheduler (continuous batching, chunked prefill, prefix caching,
preemption by recompute) over a `BlockPool`, with step times from `EngineParams`.

Each step: running requests first, in order (a decode token each, or their prompt's next chunk),
then waiting ones, first come first served, while the token budget, `max_num_seqs` and the free
blocks allow; a running request that cannot get a block preempts the last one. A new request's
cached prefix is looked up when it is admitted. Blocks full of prompt tokens are cached (a
BlockStored event) at the end of the step that computed them; a block taken for new data evicts
its hash (BlockRemoved). Steps in which only the same requests decode, and nothing waits, run as
one event until the first of them ends or a request arrives (`_fast_forward`): the sum of the
steps' times is closed-form, so a long decode costs the simulator a few events, not one per token.

Disaggregated prefill, as vLLM's NixlConnector does it. A prefill leg (`hold_kv`) keeps its blocks
after its one token until `release` (the decode side has read them). A decode leg (`remote_kv`),
when the scheduler reaches it, gets blocks for its whole prompt, reuses its cached prefix and
pulls the rest, taking `pull_s(tokens)` seconds, outside the steps and their budget (vLLM's
WAITING_FOR_REMOTE_KVS); then it waits among the requests that hold KV, which are scheduled before
any other waiting one (vLLM's `kv_holding_waiting`), and recomputes its last prompt token, which
gives its first token.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from autoscaler.signals import SIGNAL_WINDOW_S, Window
from sim.kvcache import BlockPool
from sim.loop import EventLoop
from sim.params import EngineParams


@dataclass
class SimRequest:
    """One request, and what happened to it (times are simulated seconds)."""

    request_id: str
    arrival: float  # at the gateway
    prompt_tokens: int
    block_hashes: Sequence[int]  # of the prompt's full blocks, chained as the engines hash
    output_tokens: int
    replica: str = ""
    engine_arrival: float = 0.0
    first_token: float | None = None
    finished: float | None = None
    cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    remote_kv: bool = False  # a decode leg: pull the prompt's KV from a prefill engine
    hold_kv: bool = False  # a prefill leg: keep its blocks after it ends, until `release`
    pulled_tokens: int = 0  # prompt tokens whose KV it pulled
    pull_s: float = 0.0  # how long the pull took
    prefill_leg: SimRequest | None = None  # a decode leg's prefill leg, once that has ended
    preemptions: int = 0
    itl_sum_s: float = 0.0  # sum and count of its inter-token gaps
    itl_count: int = 0


@dataclass
class _Seq:
    request: SimRequest
    computed: int = 0  # tokens with KV in the cache (prompt, then generated)
    generated: int = 0
    blocks: list[int] = field(default_factory=list)
    prefill_to: int = 0  # the prompt; after a preemption, the prompt and the tokens generated
    pulled: bool = False  # a decode leg whose pull has been started (it never pulls twice)

    def __post_init__(self) -> None:
        self.prefill_to = self.request.prompt_tokens

    @property
    def prefilling(self) -> bool:
        return self.computed < self.prefill_to

    def to_compute(self) -> int:
        return self.prefill_to - self.computed if self.prefilling else 1


@dataclass
class _FastForward:
    start: float
    ends: list[float]  # when each step ends, from the start

    @property
    def steps(self) -> int:
        return len(self.ends)

    def boundary(self, k: int) -> float:
        """When step k ends (k steps done)."""
        return self.start + self.ends[k - 1]

    def steps_done_by(self, t: float) -> int:
        """Steps ended at the first step boundary at or after `t` (at least 1)."""
        return max(1, min(self.steps, bisect.bisect_left(self.ends, t - self.start) + 1))

    def cut(self, k: int) -> _FastForward:
        return _FastForward(self.start, self.ends[:k])


Listener = Callable[[SimRequest], None]
EventListener = Callable[[list[tuple[bool, int]]], None]
PullTime = Callable[[int], float]  # seconds to pull the KV of this many tokens


class SimEngine:
    """One engine (one replica's). Callbacks run inside the loop: `on_events` with each step's KV
    events, `on_first_token` and `on_finished` per request, `on_pulled` when a decode leg has
    its prompt's KV (`pull_s` says how long that takes; an engine without it pulls nothing)."""

    def __init__(self, loop: EventLoop, params: EngineParams, name: str,
                 on_events: EventListener, on_first_token: Listener,
                 on_finished: Listener, fast_forward: bool = True,
                 pull_s: PullTime | None = None, on_pulled: Listener | None = None) -> None:
        self.loop, self.params, self.name = loop, params, name
        self._fast_forward_on = fast_forward  # off: every step an event (for checking it)
        self.pool = BlockPool(params.kv_blocks)
        self._on_events, self._on_first, self._on_finished = on_events, on_first_token, on_finished
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self.pulling: list[_Seq] = []  # decode legs whose KV is on its way
        self.pulled: deque[_Seq] = deque()  # decode legs with their KV, waiting to be scheduled
        self._held: dict[str, list[int]] = {}  # blocks of ended prefill legs, until released
        self._pull_s, self._on_pulled = pull_s, on_pulled
        self._busy = False
        self._generation = 0  # invalidates a scheduled step end when a fast-forward is cut
        self._batch: list[tuple[_Seq, int]] = []
        self._ff: _FastForward | None = None
        self._last_step_s = 0.0
        self.ttft = Window(SIGNAL_WINDOW_S)  # engine-side, from its queue to the first token
        self.itl = Window(SIGNAL_WINDOW_S)  # finished requests' mean gaps, as a replica's
        self.arrivals = 0
        self.prefill_rate = Window(SIGNAL_WINDOW_S)  # prompt tokens per second of prefill steps
        self.prompt_tokens = Window(SIGNAL_WINDOW_S)
        self.generated_tokens = Window(SIGNAL_WINDOW_S)
        self.steps = 0

    # -- requests -----------------------------------------------------------------------------

    def add(self, request: SimRequest) -> None:
        request.engine_arrival = self.loop.now
        self.arrivals += 1
        self.waiting.append(_Seq(request))
        if not self._busy:
            self._start_step()
        elif self._ff is not None:
            self._cut_fast_forward()

    def load(self) -> int:
        return len(self.running) + len(self.waiting) + len(self.pulling) + len(self.pulled)

    def release(self, request_id: str) -> None:
        """A prefill leg's KV has been read (or will not be): its blocks go back to the pool."""
        blocks = self._held.pop(request_id, None)
        if blocks is not None:
            self.pool.free(blocks)
            if not self._busy and self.waiting:  # a request may have waited for these blocks
                self._start_step()

    def queued_prompt_tokens(self) -> int:
        """Prompt tokens not computed yet, of requests still in their prefill (vLLM's count)."""
        return sum(s.prefill_to - s.computed for s in (*self.running, *self.pulled, *self.waiting)
                   if s.prefilling)  # not those pulling theirs

    def kv_usage(self) -> float:
        return self.pool.used_blocks / self.pool.num_blocks

    # -- steps --------------------------------------------------------------------------------

    def _start_step(self) -> None:
        batch = self._schedule()
        if not batch:
            self._busy = False
            return
        self._busy = True
        self._batch = batch
        ff = self._fast_forward(batch)
        if ff is not None:
            self._ff = ff
            end = ff.boundary(ff.steps)
        else:
            self._ff = None
            self._last_step_s = self._step_s(batch)
            end = self.loop.now + self._last_step_s
        self._generation += 1
        generation = self._generation
        self.loop.at(end, lambda: self._end_step(generation))

    def _step_s(self, batch: Sequence[tuple[_Seq, int]]) -> float:
        new = kv = 0
        pairs = 0.0
        for seq, n in batch:
            new += n
            kv += seq.computed + n
            pairs += n * (seq.computed + n / 2)
        return self.params.step_s(new, len(batch), kv, pairs)

    def _schedule(self) -> list[tuple[_Seq, int]]:
        """This step's requests and their new tokens (vLLM v1's order: running, then waiting)."""
        p, budget, batch = self.params, self.params.max_num_batched_tokens, []
        preempted, i = False, 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.to_compute(), budget)
            while not self._grow(seq, n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                batch.append((seq, n))
                budget -= n
                i += 1
        while not preempted and self.pulled and budget > 0 and len(self.running) < p.max_num_seqs:
            seq = self.pulled.popleft()  # its blocks are all there: it computes its last token
            self.running.append(seq)
            batch.append((seq, 1))
            budget -= 1
        while not preempted and self.waiting and budget > 0 and len(self.running) < p.max_num_seqs:
            seq = self.waiting[0]
            if seq.request.remote_kv and not seq.pulled and self._pull_s is not None:
                if not self._start_pull(seq):
                    break
                self.waiting.popleft()
                continue
            n = self._admit(seq, budget)
            if n == 0:
                break
            self.waiting.popleft()
            self.running.append(seq)
            batch.append((seq, n))
            budget -= n
        return batch

    def _grow(self, seq: _Seq, n: int) -> bool:
        need = math.ceil((seq.computed + n) / self.params.block_size) - len(seq.blocks)
        if need <= 0:
            return True
        blocks = self.pool.allocate(need)
        if blocks is None:
            return False
        seq.blocks.extend(blocks)
        return True

    def _admit(self, seq: _Seq, budget: int) -> int:
        """Tokens `seq` computes in this step if it can start now (0: it cannot): its cached
        prefix is reused (at least one prompt token is always computed)."""
        request, size = seq.request, self.params.block_size
        hits = self.pool.cached_prefix(request.block_hashes)[:(request.prompt_tokens - 1) // size]
        cached = len(hits) * size
        n = min(seq.prefill_to - cached, budget)
        need = math.ceil((cached + n) / size) - len(hits)
        evictable_hits = sum(self.pool.is_free(b) for b in hits)
        if need > self.pool.free_blocks - evictable_hits:
            return 0
        self.pool.touch(hits)
        seq.blocks = hits + (self.pool.allocate(need) or [])
        seq.computed = cached
        if request.cached_tokens == 0 and request.preemptions == 0:
            request.cached_tokens = cached
        return n

    def _start_pull(self, seq: _Seq) -> bool:
        """Blocks for the whole prompt: its cached prefix (never all of it), and new ones for the
        rest, which is pulled (False: not enough free blocks now)."""
        request, size = seq.request, self.params.block_size
        hits = self.pool.cached_prefix(request.block_hashes)[:(request.prompt_tokens - 1) // size]
        cached = len(hits) * size
        remote = request.prompt_tokens - cached
        need = math.ceil(request.prompt_tokens / size) - len(hits)
        if need > self.pool.free_blocks - sum(self.pool.is_free(b) for b in hits):
            return False
        seq.pulled = True
        self.pool.touch(hits)
        seq.blocks = hits + (self.pool.allocate(need) or [])
        seq.computed = cached
        request.cached_tokens, request.pulled_tokens = cached, remote
        request.pull_s = self._pull_s(remote)
        self.pulling.append(seq)
        self.loop.after(request.pull_s, lambda: self._pulled(seq))
        return True

    def _pulled(self, seq: _Seq) -> None:
        """The pull is done: the pulled blocks full of prompt are cached (their events go out
        with the next step's) and the request waits to recompute its last prompt token."""
        self.pulling.remove(seq)
        self._computed(seq, seq.request.prompt_tokens - 1 - seq.computed)
        self.pulled.append(seq)
        if self._on_pulled is not None:
            self._on_pulled(seq.request)
        if not self._busy:
            self._start_step()
        elif self._ff is not None:
            self._cut_fast_forward()

    def _preempt(self, seq: _Seq) -> None:
        """Recompute later, the tokens it generated included: its blocks are freed (cached ones
        stay findable) and it waits first."""
        self.pool.free(seq.blocks)
        seq.blocks, seq.computed = [], 0
        seq.prefill_to = seq.request.prompt_tokens + seq.generated
        seq.request.preemptions += 1
        self.waiting.appendleft(seq)

    def _fast_forward(self, batch: list[tuple[_Seq, int]]) -> _FastForward | None:
        """Several identical decode steps as one, when nothing else can change before the first
        of these requests ends: nothing waits, all decode, their blocks for all steps are free."""
        if (not self._fast_forward_on or self.waiting or self.pulled
                or len(batch) != len(self.running)
                or any(s.prefilling or s.generated == 0 for s, _ in batch)):
            return None
        steps = min(s.request.output_tokens - s.generated for s, _ in batch)
        if steps < 2:
            return None
        size = self.params.block_size
        need = sum(math.ceil((s.computed + steps) / size) - len(s.blocks) for s, _ in batch)
        if need > self.pool.free_blocks:
            return None
        first = self._step_s(batch)
        delta = (self.params.per_kv_token_s + self.params.per_attn_pair_s) * len(batch)
        # step k reads k more tokens per request than the first
        ends = list(itertools.accumulate(first + delta * k for k in range(steps)))
        return _FastForward(self.loop.now, ends)

    def _cut_fast_forward(self) -> None:
        """A request arrived during a fast-forward: the decode steps end at the next step
        boundary, where the scheduler sees it."""
        ff = self._ff
        done = ff.steps_done_by(self.loop.now)
        if done >= ff.steps:
            return
        self._ff = ff.cut(done)
        self._generation += 1
        generation = self._generation
        self.loop.at(max(self.loop.now, self._ff.boundary(done)),
                     lambda: self._end_step(generation))

    def _end_step(self, generation: int) -> None:
        if generation != self._generation:
            return
        now, ff, batch = self.loop.now, self._ff, self._batch
        steps = ff.steps if ff is not None else 1
        duration = now - ff.start if ff is not None else self._last_step_s
        self.steps += steps
        prefill_tokens = 0
        for seq, n in batch:
            if ff is not None:
                self._decode(seq, steps, ff)
                continue
            if seq.prefilling:
                prefill_tokens += n
                self._computed(seq, n)
                if not seq.prefilling:
                    self._token(seq, now, duration)
            else:
                self._computed(seq, 1)
                self._token(seq, now, duration)
        if prefill_tokens:
            self.prefill_rate.add(prefill_tokens / duration, now)
            self.prompt_tokens.add(prefill_tokens, now)
        events = self.pool.take_events()
        if events:
            self._on_events(events)
        self._ff = None
        self._finish_done(now)
        self._start_step()

    def _computed(self, seq: _Seq, n: int) -> None:
        """`n` more tokens of `seq` have KV; prompt blocks that became full are cached."""
        size, request = self.params.block_size, seq.request
        full_before = min(seq.computed, request.prompt_tokens) // size
        seq.computed += n
        full_after = min(seq.computed, request.prompt_tokens) // size
        hashes = request.block_hashes
        for k in range(full_before, min(full_after, len(hashes))):
            self.pool.cache(seq.blocks[k], hashes[k])

    def _token(self, seq: _Seq, now: float, gap: float) -> None:
        request = seq.request
        seq.generated += 1
        self.generated_tokens.add(1, now)
        if request.first_token is None:
            request.first_token = now
            self.ttft.add(now - request.engine_arrival, now)
            self._on_first(request)
        else:
            request.itl_sum_s += gap
            request.itl_count += 1

    def _decode(self, seq: _Seq, steps: int, ff: _FastForward) -> None:
        """`steps` decode steps of a fast-forward at once."""
        size = self.params.block_size
        need = math.ceil((seq.computed + steps) / size) - len(seq.blocks)
        if need > 0:
            seq.blocks.extend(self.pool.allocate(need) or [])
        seq.computed += steps
        seq.generated += steps
        request = seq.request
        span = ff.boundary(steps) - ff.start
        request.itl_sum_s += span
        request.itl_count += steps
        now = self.loop.now
        self.generated_tokens.add(steps, now)

    def _finish_done(self, now: float) -> None:
        kept = []
        for seq in self.running:
            if seq.generated >= seq.request.output_tokens:
                seq.request.finished = now
                if seq.request.itl_count:
                    self.itl.add(seq.request.itl_sum_s / seq.request.itl_count, now)
                if seq.request.hold_kv:
                    self._held[seq.request.request_id] = seq.blocks
                else:
                    self.pool.free(seq.blocks)
                seq.blocks = []
                self._on_finished(seq.request)
            else:
                kept.append(seq)
        self.running = kept
