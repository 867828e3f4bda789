"""The `kv_transfer_params` a request carries between the prefill and the decode engine."""

from __future__ import annotations

from typing import Any, TypeGuard

# Sent with the prefill request: keep the KV blocks for a remote decoder to pull.
REMOTE_DECODE: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

# Per-token-count limits that the prefill leg must not inherit from the client's request.
_OUTPUT_LIMITS = ("max_tokens", "max_completion_tokens", "min_tokens", "n", "best_of")
_STREAMING = ("stream", "stream_options")


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The client's request turned into its prefill leg: one token, not streamed."""
    leg = {k: v for k, v in body.items() if k not in _OUTPUT_LIMITS + _STREAMING}
    return leg | {"max_tokens": 1, "kv_transfer_params": dict(REMOTE_DECODE)}


def decode_body(body: dict[str, Any], params: dict[str, Any] | None) -> dict[str, Any]:
    """The client's request for the decode engine, pulling the prefilled KV when params exist."""
    return body | {"kv_transfer_params": params} if params else dict(body)


def is_transferable(params: Any) -> TypeGuard[dict[str, Any]]:
    """Whether a prefill reply's params name blocks a decoder can pull."""
    return isinstance(params, dict) and bool(params.get("remote_block_ids")) and bool(
        params.get("remote_engine_id"))
