"""Counts a request's prompt tokens the way the engine will see them (same tokenizer and template).

Used outside the engines, where a decision depends on prompt length (prefill/decode disaggregation).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class PromptTokenCounter:
    """Loads the model's tokenizer once; `tokens` is CPU work: call it off the event loop."""

    def __init__(self, model_path: str) -> None:
        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(model_path)

    def tokens(self, endpoint: str, body: dict[str, Any]) -> list[int] | None:
        """Prompt token ids of an OpenAI request body; None when it has no prompt we can read."""
        if endpoint == "chat":
            messages = body.get("messages")
            if not isinstance(messages, list):
                return None
            ids = self._tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                      tokenize=True)
            # transformers 5 returns a BatchEncoding (a mapping, not a dict); 4 returned a list
            return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return self._tokenizer(prompt).input_ids
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return prompt
        return None
