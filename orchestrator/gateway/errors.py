"""Errors the gateway answers itself, as OpenAI error objects with the right status."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from pools.engine import openai_error


class GatewayError(Exception):
    """A request the gateway answers itself, with an OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after_s = retry_after_s

    def response(self) -> JSONResponse:
        response = error_response(self.status, self.message, self.param, self.code)
        if self.retry_after_s is not None:  # whole seconds, rounded up, at least 1
            response.headers["retry-after"] = str(max(1, -int(-self.retry_after_s // 1)))
        return response


def error_response(status: int, message: str, param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    if code is None and status == 404 and param == "model":
        code = "model_not_found"
    return JSONResponse(openai_error(status, message, param, code), status_code=status)
