"""Prompts compared token for token between the endpoint and a bare vLLM engine.

Every prompt starts differently so none hits another's cached prefix (a cache hit changes the
kernels' shapes, and with them the last bits of the arithmetic). The topologies compared with
the bare engine run in float32: in bfloat16 the random tiny model's logits tie exactly (a bare
engine's own second run of the several-blocks prompt, its prefix cached, picks another token at
position 21, where the two top logprobs are equal), so any two paths may differ.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Prompt:
    id: str
    prompt: str
    max_tokens: int


@dataclass(frozen=True)
class Chat:
    id: str
    messages: list
    max_tokens: int


def _words(seed: str, count: int) -> str:
    vocab = ["river", "stone", "light", "market", "seven", "quiet", "engine", "paper", "green",
             "north", "window", "table", "music", "forty", "silver", "garden", "road", "cloud"]
    return " ".join(vocab[(len(seed) * 7 + i * 5 + i // 3) % len(vocab)] for i in range(count))


PROMPTS = [
    Prompt("short", "Hello, my name is", 24),
    Prompt("one-block", "Once upon a time " + _words("one-block", 50), 24),
    Prompt("several-blocks", "In the beginning " + _words("several", 230), 24),
    Prompt("near-limit", "At the very edge " + _words("near-limit", 800), 8),
]

# Sent once, by the test that kills the prefill replica: decode has never seen it.
FALLBACK = Prompt("fallback", "When the prefill replica is gone " + _words("fallback", 80), 16)

CHATS = [
    Chat("single-turn", [{"role": "user", "content": "What is the capital of France?"}], 24),
    Chat("with-system", [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one?"},
    ], 24),
]
