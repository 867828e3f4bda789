"""What one connection may make an ingress hold, and for how long: the HTTP server's limits
(the topology's gateway section sets them; orchestrator.gateway_config says why each default).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    """One ingress's limits; the defaults are the topology's."""

    header_timeout_s: float = 10.0  # from a request's first byte to the end of its head
    body_timeout_s: float = 60.0  # from the end of its head to the end of its body
    idle_timeout_s: float = 75.0  # a kept-alive connection with no request for this long
    max_connections: int = 8192  # open connections of this process
    max_connections_per_client: int | None = 1024  # of one client address
    stalled_client_timeout_s: float = 60.0  # a reply the client has not read for this long
    write_buffer_bytes: int = 64 << 10  # a reply buffered beyond this: the client is not reading
    # The kernel's send buffer of a client connection (SO_SNDBUF, which Linux doubles). Left to
    # itself it grows to tcp_wmem's maximum (4 MiB by default), so a whole reply of a client
    # that reads nothing would wait there, unseen by the stall timeout and never stopped in its
    # engine. 128 KiB in flight still carries a token stream at far more than engines make it.
    send_buffer_bytes: int = 64 << 10


LIMIT_REASONS = ("header_timeout", "body_timeout", "max_connections",
                 "max_connections_per_client", "stalled_client")
