"""Errors the gateway answers itself, as OpenAI error objects with the right status."""

from __future__ import annotations

import msgspec

from orchestrator.gateway.responder import Responder
from tokenfab.errors import TokenfabError, openai_error


class GatewayError(TokenfabError):
    """A request the gateway answers itself, with an OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return {}
        return {"retry-after": str(max(1, -int(-self.retry_after_s // 1)))}  # whole seconds, up

    def send(self, responder: Responder, headers: dict[str, str] | None = None) -> None:
        send_error(responder, self.status, self.message, self.param, self.code,
                   (headers or {}) | self.headers())

    def sse(self) -> bytes:
        """The error as one server-sent event, for a stream whose headers are already sent."""
        return b"data: " + error_body(self.status, self.message, self.param, self.code) + b"\n\n"


class ReplicaFailed(GatewayError):
    """The replica a request was on failed, or went away, before the request was answered: a
    503 unless the flow can send it to another replica (nothing reached the client yet)."""

    def __init__(self, replica: str, message: str) -> None:
        super().__init__(503, message, code="replica_failed")
        self.replica = replica


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> bytes:
    if code is None and status == 404 and param == "model":
        code = "model_not_found"
    return msgspec.json.encode(openai_error(status, message, param, code))


def send_error(responder: Responder, status: int, message: str, param: str | None = None,
               code: str | None = None, headers: dict[str, str] | None = None) -> None:
    responder.send(status, error_body(status, message, param, code), headers)
