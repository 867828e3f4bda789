"""Other projects' routers, adapted to tokenfab's request shape so benchmarks compare them in the
same harness. Selected with `router.policy` like the built-in policies; never the default.
"""

from __future__ import annotations

from typing import Any

from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
    PrefixCacheAffinityRouter,
)

RAY_PREFIX_AFFINITY = "router.baselines:RayPrefixAffinityRouter"


class RayPrefixAffinityRouter(PrefixCacheAffinityRouter):
    """Ray Serve LLM's `PrefixCacheAffinityRouter` (character prefix tree, imbalance threshold),
    unchanged except that it reads the prompt from tokenfab's `(endpoint, body)` arguments."""

    def _extract_text_from_request(self, pending_request: Any) -> str:
        body = pending_request.args[1] if len(pending_request.args) > 1 else {}
        prompt = body.get("messages") if "messages" in body else body.get("prompt")
        if prompt is None:
            raise ValueError("request has neither `prompt` nor `messages`")
        return self._normalize_prompt_to_string(prompt)
