"""Which engine served each request behind a third-party router: ASGI middleware for a vLLM
OpenAI server (`--middleware benchmarks.common.engine_log.RequestLog`) that appends
one JSON line per `/v1/completions` request to the file `ENGINE_REQUEST_LOG` names: the time it
arrived and a digest of its prompt (benchmarks/port_fidelity.py reads them).

The line is written when the request's body has been read, before the engine sees it: one small
append, a few microseconds on the server's loop, in benchmark runs only.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Any


def digest(prompt: Any) -> str:
    return hashlib.sha1(json.dumps(prompt).encode()).hexdigest()[:16]


class RequestLog:
    def __init__(self, app: Any) -> None:
        self.app, self.path = app, os.environ["ENGINE_REQUEST_LOG"]

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("path") != "/v1/completions":
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []

        async def body() -> dict:
            message = await receive()
            if message["type"] == "http.request":
                chunks.append(message.get("body", b""))
                if not message.get("more_body"):
                    prompt = json.loads(b"".join(chunks) or b"{}").get("prompt")
                    with open(self.path, "a") as out:
                        out.write(json.dumps({"at": time.time(), "prompt": digest(prompt)}) + "\n")
            return message

        await self.app(scope, body, send)
