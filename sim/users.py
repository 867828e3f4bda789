"""Chat users as a closed loop: each user sends a conversation's next turn only after its answer
ended and the user has read it and typed, so no turn arrives before the turn it follows exists.

A user holds one conversation at a time, over one of `system_prompts` shared system prompts (2-8
hash ids, Zipf popularity); a conversation has 1 + Exp(3) turns (mean 4), each sending the whole
conversation so far: one hash id of user text and one of the last answer more each time. Between
an answer's end and the next turn, and between conversations, the user thinks for Exp(`think_s`)
seconds. Users begin at uniform offsets over the first `think_s` seconds and send no turn after
`window_s`; the load, in requests per second, is what the pool's answers let them send.

Example: with think time 10 s, a conversation on system prompt [0, 1] sends [0, 1, u1] at t, and
[0, 1, u1, a1, u2] about 10 s after the first answer ended.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from sim.engine import SimRequest
from sim.loop import EventLoop
from sim.workload import block_hashes

_TURNS_MEAN = 3  # turns beyond the first, exponential: mean 4 per conversation


@dataclass(frozen=True)
class Shape:
    """What the users send: lengths, think time and how long they send."""

    tokens_per_id: int  # prompt tokens per hash id (512 in the Mooncake format)
    block_size: int  # the engines' block, a divisor of tokens_per_id
    max_prompt_tokens: int  # a conversation that would send more ends, and another starts
    max_output_tokens: int
    think_s: float
    window_s: float


@dataclass
class _Conversation:
    history: list[int]
    turns_left: int  # turns still to send, this one included
    index: int = 0  # turns sent


class Users:
    """`count` users on `loop`, each turn handed to `submit` when sent; tell `finished` of each
    request that ends. Owned by the loop's callbacks; `sent` lists every request in send order."""

    def __init__(self, loop: EventLoop, count: int, shape: Shape, system_prompts: int,
                 submit: Callable[[SimRequest], None], seed: int = 0) -> None:
        self._loop, self._shape, self._submit = loop, shape, submit
        self._rng = random.Random(seed)
        rng = self._rng
        self._prompts = [list(range(1_000_000 * (p + 1), 1_000_000 * (p + 1) + rng.randint(2, 8)))
                         for p in range(system_prompts)]
        self._weights = [1 / (rank + 1) for rank in range(system_prompts)]  # Zipf, s = 1
        self._serial = 10**9  # user text and answers: ids no system prompt has
        self._users: dict[str, tuple[int, _Conversation]] = {}  # request id -> its user's
        self.sent: list[SimRequest] = []
        for user in range(count):
            loop.at(rng.uniform(0.0, shape.think_s), lambda u=user: self._send(u, None))

    def finished(self, request: SimRequest) -> None:
        """The user reads the answer and thinks, then sends the conversation's next turn."""
        user, conversation = self._users.pop(request.request_id)
        conversation.history.append(self._next_id())  # the answer, sent back with the next turn
        pause = self._rng.expovariate(1 / self._shape.think_s)
        following = conversation if conversation.turns_left > 0 else None
        self._loop.after(pause, lambda: self._send(user, following))

    def _send(self, user: int, conversation: _Conversation | None) -> None:
        shape = self._shape
        if self._loop.now > shape.window_s:
            return
        conversation = conversation or self._open()
        conversation.history.append(self._next_id())  # the user's next message
        length = len(conversation.history) * shape.tokens_per_id + 1  # and the BOS token
        if length > shape.max_prompt_tokens and conversation.index > 0:
            conversation = self._open()  # too long to send: the user starts over
            conversation.history.append(self._next_id())
            length = len(conversation.history) * shape.tokens_per_id + 1
        prompt = min(length, shape.max_prompt_tokens)
        full = min(prompt // shape.block_size,
                   len(conversation.history) * (shape.tokens_per_id // shape.block_size))
        request = SimRequest(
            request_id=f"u{user}-{len(self.sent)}", arrival=self._loop.now, prompt_tokens=prompt,
            block_hashes=block_hashes(conversation.history, full, shape.tokens_per_id,
                                      shape.block_size),
            output_tokens=max(1, min(shape.max_output_tokens, self._rng.randint(64, 512))))
        conversation.index += 1
        conversation.turns_left -= 1
        self._users[request.request_id] = (user, conversation)
        self.sent.append(request)
        self._submit(request)

    def _open(self) -> _Conversation:
        prompt = self._rng.choices(self._prompts, self._weights)[0]
        return _Conversation(list(prompt), 1 + int(self._rng.expovariate(1 / _TURNS_MEAN)))

    def _next_id(self) -> int:
        self._serial += 1
        return self._serial
