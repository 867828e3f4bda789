"""tokenfab's exceptions, drawn in one place.

    TokenfabError
    ├── TopologyError        a topology file or document is invalid (carries one line per problem)
    ├── ClusterError         Ray or Serve cannot be reached, or a deployment failed
    ├── EngineError          an engine replica failed (distinct from a bad request)
    │   └── EngineDeadError  the engine process is gone; the replica must be replaced
    ├── ChannelError         the data channel between a gateway and a pool replica failed
    │   ├── LinkLost         the connection broke or could not be made: the replica is gone
    │   ├── ReplyFailed      the replica broke off a reply (its engine failed while serving it)
    │   └── ProtocolError    the peer broke the wire format; the connection must be closed
    ├── PromptError          a request's prompt cannot be read (names the field; a ValueError)
    ├── SimConfigError       a simulator profile, or options that do not fit it (a ValueError)
    ├── CompatError          a dependency's version is not one tokenfab's patches of it know
    └── GatewayError         a request the gateway answers itself, as an OpenAI error object
        └── ReplicaFailed    (orchestrator/gateway/errors.py, with how each is sent)

Foreign errors (pydantic, yaml, httpx, vLLM) are translated to these at the module that meets them.
Every HTTP answer's error body is `openai_error`'s shape.
"""

from __future__ import annotations

from typing import Any

OPENAI_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError",
                      403: "PermissionDeniedError", 404: "NotFoundError", 405: "MethodNotAllowed",
                      413: "RequestTooLarge", 429: "RateLimitError",
                      503: "ServiceUnavailableError", 504: "GatewayTimeout"}


def openai_error(status: int, message: str, param: str | None = None,
                 code: int | str | None = None) -> dict[str, Any]:
    """The OpenAI error object every tokenfab component answers with."""
    kind = OPENAI_ERROR_TYPES.get(status, "InternalServerError")
    return {"error": {"message": message, "type": kind, "param": param,
                      "code": status if code is None else code}}


class TokenfabError(Exception):
    """Base of every error tokenfab raises on purpose."""


class TopologyError(TokenfabError):
    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


class ClusterError(TokenfabError):
    """Ray, the Serve controller or the dashboard failed or is unreachable."""


class EngineError(TokenfabError):
    """An engine replica failed while serving a request."""


class EngineDeadError(EngineError):
    """The engine process died; the replica is unhealthy until Serve replaces it."""


class ChannelError(TokenfabError):
    """The data channel between a gateway and a pool replica failed."""


class LinkLost(ChannelError):
    """The connection to the replica broke, or could not be made: the replica is gone or
    unreachable (distinct from a reply that failed)."""


class ReplyFailed(ChannelError):
    """The replica broke off the reply (its engine failed while serving it)."""


class ProtocolError(ChannelError):
    """The peer broke the wire format; the connection must be closed."""


class PromptError(TokenfabError, ValueError):
    """The request's prompt cannot be read; `field` names where (e.g. "messages[0].content")."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


class SimConfigError(TokenfabError, ValueError):
    """A profile, or options that do not fit it (what `python -m sim` reports without a trace)."""


class CompatError(TokenfabError):
    """An installed dependency is a version that one of tokenfab's patches of it was not written
    for (tokenfab.compat.require)."""
