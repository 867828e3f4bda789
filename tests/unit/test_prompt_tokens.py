"""The gateway counts prompts with the tokenizer's Rust core (pools.tokenizer): the same ids as
the tokenizer called the usual way, which is how the engine would have tokenised them."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer
from tokenizers.processors import TemplateProcessing
from transformers import PreTrainedTokenizerFast

from pools.tiny_model import BOS, _hf_tokenizer
from pools.tokenizer import PromptTokenCounter

TEXTS = [
    "hello world",
    "w1 w2 w3 " * 300,  # a long prompt
    "héllo 世界 e\u0301 🙂 \x00 \t\n",  # multi-byte characters, a combining mark, control bytes
    "<s> a literal special token </s> and <|im_start|> too",  # special tokens, as text
    " leading and trailing spaces ",
    "",
]


def _with_bos(tokenizer: PreTrainedTokenizerFast) -> PreTrainedTokenizerFast:
    """The tiny tokenizer with a post-processor that adds BOS, as Llama's does: a completion
    prompt gets it, a rendered chat (add_special_tokens=False) does not."""
    core = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    core.post_processor = TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, core.token_to_id(BOS))])
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token=BOS, eos_token=tokenizer.eos_token,
        unk_token=tokenizer.unk_token, pad_token=tokenizer.pad_token,
        chat_template=tokenizer.chat_template, clean_up_tokenization_spaces=False)


@pytest.fixture(scope="module", params=["tiny", "adds BOS"])
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
          ) -> tuple[PreTrainedTokenizerFast, PromptTokenCounter]:
    tokenizer = _hf_tokenizer(seed=0)
    if request.param == "adds BOS":
        tokenizer = _with_bos(tokenizer)
        assert tokenizer("x").input_ids[0] == tokenizer.bos_token_id
    path = Path(tmp_path_factory.mktemp("tokenizer"))
    tokenizer.save_pretrained(path)
    return tokenizer, PromptTokenCounter(str(path))


@pytest.mark.parametrize("text", TEXTS)
def test_a_completion_prompt_counts_as_the_tokenizer_tokenises_it(saved, text: str) -> None:
    tokenizer, counter = saved
    assert counter.prompts("completions", {"prompt": text}) == [tokenizer(text).input_ids]
    assert counter.prompts("completions", {"prompt": [text, "x"]}) == \
        [tokenizer(text).input_ids, tokenizer("x").input_ids]


def test_a_chat_counts_as_the_rendered_template_tokenised(saved) -> None:
    tokenizer, counter = saved
    messages = [{"role": "system", "content": "be brief <s>"},
                {"role": "user", "content": [{"type": "text", "text": "héllo"},
                                             {"type": "text", "text": "w1 w2"}]}]
    expected = tokenizer.apply_chat_template(
        [messages[0], {"role": "user", "content": "héllo\nw1 w2"}], add_generation_prompt=True,
        tokenize=True)
    expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    assert counter.prompts("chat", {"messages": messages}) == [expected]


def test_truncation_in_the_tokenizer_file_does_not_cut_the_count(tmp_path: Path) -> None:
    """A tokenizer.json may carry truncation; `tokenizer(text)` ignores it (it resets it on every
    call), and so must the count."""
    tokenizer = _hf_tokenizer(seed=0)
    tokenizer.backend_tokenizer.enable_truncation(4)
    tokenizer.save_pretrained(tmp_path)
    assert '"truncation": {' in (tmp_path / "tokenizer.json").read_text()
    ids = PromptTokenCounter(str(tmp_path)).prompts("completions", {"prompt": TEXTS[1]})[0]
    tokenizer.backend_tokenizer.no_truncation()
    assert ids == tokenizer(TEXTS[1]).input_ids and len(ids) > 4
