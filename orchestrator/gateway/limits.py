"""Per-tenant rate and size limits: token buckets for requests and tokens per minute, a count of
requests in flight, and the largest prompt and output a tenant may ask for.

A bucket holds up to one minute's allowance and refills continuously. A request takes 1 from the
request bucket and `prompt + max_tokens` from the token bucket; when it ends, the tokens it did
not generate go back. If a bucket is short, nothing is taken and the caller gets the seconds until
it would not be: the `Retry-After` of the 429.

Worked example: tokens_per_minute 6000 refills 100 tokens/s. A tenant that just spent the whole
minute's allowance sends a request of 500 prompt + 100 max tokens: 600 tokens are 6 s away, so
it gets 429 with Retry-After: 6. Had its last request generated only 20 of its 100 max tokens,
80 came back at once and the wait is 5.2 s, Retry-After: 6 (whole seconds, rounded up).

Limits are per ingress replica: with N of them, each enforces 1/N of the allowance. N is
`gateway.replicas`, or with `gateway.colocate` the pool's replicas as the registry lists them
now (its buckets are resized as replicas come and go).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from orchestrator.gateway.errors import GatewayError
from orchestrator.tenant_config import TenantLimits


class TokenBucket:
    """`capacity` units, refilled at `capacity / 60` per second; the clock is passed in."""

    def __init__(self, per_minute: float, now: float) -> None:
        self.capacity = per_minute
        self._rate = per_minute / 60.0
        self._level, self._at = per_minute, now

    def _refill(self, now: float) -> None:
        self._level = min(self.capacity, self._level + (now - self._at) * self._rate)
        self._at = now

    def wait_s(self, amount: float, now: float) -> float:
        """Seconds until `amount` could be taken (0: now)."""
        self._refill(now)
        return max(0.0, (amount - self._level) / self._rate)

    def take(self, amount: float, now: float) -> None:
        self._refill(now)
        self._level -= amount

    def resize(self, per_minute: float, now: float) -> None:
        """A new allowance; the level keeps its fraction of the capacity."""
        self._refill(now)
        self._level *= per_minute / self.capacity
        self.capacity, self._rate = per_minute, per_minute / 60.0

    def give_back(self, amount: float, now: float) -> None:
        """Return `amount` (negative: take more, possibly below zero)."""
        self._refill(now)
        self._level = min(self.capacity, self._level + amount)


@dataclass
class Charge:
    """What one admitted request took: returned in part when it ends."""

    tokens: int


class TenantLimiter:
    """One tenant's limits on one ingress replica. Not thread-safe: call from the event loop."""

    def __init__(self, limits: TenantLimits, share: float, now: float) -> None:
        self.limits, self.share = limits, share
        scaled = self._scaled(share)
        self._requests = TokenBucket(scaled["rpm"], now) if scaled["rpm"] else None
        self._tokens = TokenBucket(scaled["tpm"], now) if scaled["tpm"] else None
        self._max_concurrent = max(1, math.floor(scaled["concurrent"])) \
            if scaled["concurrent"] else None
        self.in_flight = 0

    def _scaled(self, share: float) -> dict[str, float | None]:
        limits = self.limits
        return {name: None if value is None else value * share
                for name, value in (("rpm", limits.requests_per_minute),
                                    ("tpm", limits.tokens_per_minute),
                                    ("concurrent", limits.max_concurrent))}

    def rescale(self, share: float, now: float) -> None:
        """This replica's share of the allowance changed (ingress replicas came or went): each
        bucket keeps how full it is, as a fraction, at its new size.

        Example: 600 requests per minute, a share of 1/2 with 150 left -> a share of 1/3 holds
        200 with 100 left."""
        scaled, self.share = self._scaled(share), share
        for bucket, size in ((self._requests, scaled["rpm"]), (self._tokens, scaled["tpm"])):
            if bucket is not None and size:
                bucket.resize(size, now)
        if scaled["concurrent"]:
            self._max_concurrent = max(1, math.floor(scaled["concurrent"]))

    def check_sizes(self, prompt_tokens: int | None, max_tokens: int | None,
                    prompt_field: str = "prompt") -> None:
        """400 for a request no wait would make acceptable (`prompt_tokens`: its longest)."""
        limit = self.limits.max_prompt_tokens
        if limit is not None and prompt_tokens is not None and prompt_tokens > limit:
            raise GatewayError(400, f"prompt has {prompt_tokens} tokens; this tenant's limit is "
                               f"{limit}", prompt_field, code="prompt_too_long")
        limit = self.limits.max_output_tokens
        if limit is not None and max_tokens is not None and max_tokens > limit:
            raise GatewayError(400, f"max_tokens {max_tokens} is above this tenant's limit of "
                               f"{limit}", "max_tokens", code="max_tokens_too_large")

    def admit(self, tokens: int, now: float) -> Charge:
        """Take one request and `tokens` from the tenant's allowance, or raise 429 with the
        seconds until it would succeed."""
        if self._max_concurrent is not None and self.in_flight >= self._max_concurrent:
            raise GatewayError(429, f"too many concurrent requests: this tenant's limit is "
                               f"{self._max_concurrent}", code="concurrency_limit",
                               retry_after_s=1.0)
        if self._tokens is not None and tokens > self._tokens.capacity:
            raise GatewayError(429, f"request needs {tokens} tokens (prompt + max_tokens), more "
                               f"than this tenant's {self._tokens.capacity:g} tokens per minute",
                               code="tokens_per_minute", retry_after_s=60.0)
        waits = [(self._requests.wait_s(1, now), "requests_per_minute")] if self._requests else []
        if self._tokens is not None:
            waits.append((self._tokens.wait_s(tokens, now), "tokens_per_minute"))
        wait, limit = max(waits, default=(0.0, ""))
        if wait > 0:
            raise GatewayError(429, f"rate limit reached ({limit}); retry in {wait:.1f} s",
                               code=limit, retry_after_s=wait)
        if self._requests is not None:
            self._requests.take(1, now)
        if self._tokens is not None:
            self._tokens.take(tokens, now)
        self.in_flight += 1
        return Charge(tokens)

    def release(self, charge: Charge, used_tokens: int | None, now: float) -> None:
        """The request ended having used `used_tokens` (None: unknown, nothing comes back)."""
        self.in_flight -= 1
        if self._tokens is not None and used_tokens is not None:  # more used: the debt stays
            self._tokens.give_back(charge.tokens - used_tokens, now)

    def refund(self, charge: Charge, now: float) -> None:
        """The request never reached an engine: its request and all its tokens come back."""
        self.release(charge, 0, now)
        if self._requests is not None:
            self._requests.give_back(1, now)
