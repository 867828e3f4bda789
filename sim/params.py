"""An engine's parameters: its scheduler's limits, its KV cache, and the law of its step time.

    step_s = step_base_s + per_token_s * new_tokens + per_seq_s * seqs
             + per_kv_token_s * kv_tokens + per_attn_pair_s * attn_pairs

over the requests one engine step runs: `new_tokens` computed in the step (prefill chunks plus one
per decoding request), `seqs` the requests in the step, `kv_tokens` the context each one reads
(its tokens before the step plus its new ones), `attn_pairs` the attention work of the new tokens
(n * (before + n / 2) per request). A profile is JSON (`sim/profiles/*.json`): one written by
`python -m sim calibrate` from a real engine, one derived for a GPU from published figures.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from tokenfab.errors import SimConfigError

PROFILES = Path(__file__).parent / "profiles"


class EngineParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    block_size: int
    kv_blocks: int  # KV cache capacity of one engine (one replica), in blocks
    max_num_batched_tokens: int  # the scheduler's token budget per step (chunked prefill)
    max_num_seqs: int
    max_model_len: int
    step_base_s: float
    per_token_s: float
    per_seq_s: float = 0.0
    per_kv_token_s: float = 0.0
    per_attn_pair_s: float = 0.0
    request_overhead_s: float = 0.0  # gateway and engine front, from the client's send to the
    # engine's queue and from its first token back to the client (added to every TTFT)
    overhead_per_stream_s: float = 0.0  # more of it for each request already on the replica:
    # its front relays their tokens on the same event loop and cores
    start_latency_s: float = 40.0  # a new replica's start, from the decision to its first request
    kv_bytes_per_token: int = 0  # KV cache bytes of one token (all layers): what P/D transfers
    source: str = ""  # how these numbers were obtained

    def step_s(self, new_tokens: int, seqs: int, kv_tokens: int, attn_pairs: float) -> float:
        return (self.step_base_s + self.per_token_s * new_tokens + self.per_seq_s * seqs
                + self.per_kv_token_s * kv_tokens + self.per_attn_pair_s * attn_pairs)

    def overhead_s(self, streams: int) -> float:
        """A request's overhead on a replica that has `streams` requests already."""
        return self.request_overhead_s + self.overhead_per_stream_s * streams

    def with_kv_blocks(self, kv_blocks: int) -> EngineParams:
        return msgspec.structs.replace(self, kv_blocks=kv_blocks)


def load(name_or_path: str | Path) -> EngineParams:
    """A profile by name (`cpu-tiny`, a file in sim/profiles) or by path."""
    path = Path(name_or_path)
    if path.suffix != ".json":
        path = PROFILES / f"{name_or_path}.json"
    try:
        return msgspec.json.decode(path.read_bytes(), type=EngineParams)
    except FileNotFoundError as exc:
        known = sorted(p.stem for p in PROFILES.glob("*.json"))
        raise SimConfigError(
            f"engine profile {str(name_or_path)!r}: no such file (known: {known})") \
            from exc
    except msgspec.ValidationError as exc:
        raise SimConfigError(f"engine profile {path}: {exc}") from exc


def dump(params: EngineParams, path: Path) -> None:
    path.write_bytes(msgspec.json.format(msgspec.json.encode(params), indent=2) + b"\n")
