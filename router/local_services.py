"""The routing services of this process, by (Serve application, deployment): the gateway
registers them, Ray Serve's request router (router/serve_router.py) looks them up."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from router.service import RoutingService

_services: dict[tuple[str, str], RoutingService] = {}
_lock = threading.Lock()


def register(app: str, deployment: str, service: RoutingService) -> None:
    with _lock:
        _services[(app, deployment)] = service


def unregister(app: str, deployment: str) -> None:
    with _lock:
        _services.pop((app, deployment), None)


def lookup(app: str, deployment: str) -> RoutingService | None:
    with _lock:
        return _services.get((app, deployment))
