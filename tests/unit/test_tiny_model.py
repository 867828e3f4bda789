"""Tests for the offline tiny-model builder."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoTokenizer

from pools.tiny_model import build_tiny_model, ensure_tiny_model, model_digest


@pytest.fixture(scope="module")
def dense_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "dense")


@pytest.fixture(scope="module")
def tokenizer(dense_model: Path):
    return AutoTokenizer.from_pretrained(dense_model)


def _mtimes(path: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in path.iterdir()}


def test_same_seed_gives_identical_files(dense_model: Path, tmp_path: Path) -> None:
    again = build_tiny_model(tmp_path / "again", seed=0)
    assert model_digest(again) == model_digest(dense_model)
    other = build_tiny_model(tmp_path / "other", seed=1)
    assert model_digest(other) != model_digest(dense_model)


def test_digest_covers_file_bytes(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"x")
    before = model_digest(tmp_path)
    (tmp_path / "a").write_bytes(b"y")
    assert model_digest(tmp_path) != before
    assert re.fullmatch("[0-9a-f]{64}", before)


@pytest.mark.parametrize(
    "text",
    ["Hello world.", "  two  spaces\tand\nnewline", "naïve café 日本語 🎉", "Straße, 12345!"],
)
def test_tokenizer_round_trips(tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text


def test_special_tokens(tokenizer) -> None:
    assert tokenizer.bos_token == "<s>"
    assert tokenizer.eos_token == "</s>"
    assert tokenizer.pad_token == "<pad>"
    assert tokenizer.unk_token == "<unk>"
    for token in ("<|im_start|>", "<|im_end|>"):
        assert tokenizer.encode(token, add_special_tokens=False) == [
            tokenizer.convert_tokens_to_ids(token)
        ]


def test_chat_template_is_chatml(tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi ü"},
    ]
    rendered = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi ü<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_dense_config(dense_model: Path, tokenizer) -> None:
    config = AutoConfig.from_pretrained(dense_model)
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.num_hidden_layers, config.hidden_size) == (4, 256)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.intermediate_size == 512
    assert config.max_position_embeddings == 4096
    assert config.vocab_size == len(tokenizer) == 2048
    assert config.tie_word_embeddings is False
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
    )


def test_generation_config_stops_on_chat_end(dense_model: Path, tokenizer) -> None:
    generation = json.loads((dense_model / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [
        tokenizer.eos_token_id,
        tokenizer.convert_tokens_to_ids("<|im_end|>"),
    ]
    assert generation["bos_token_id"] == tokenizer.bos_token_id


def test_moe_config(tmp_path: Path) -> None:
    config = AutoConfig.from_pretrained(build_tiny_model(tmp_path / "moe", moe=True))
    assert config.architectures == ["MixtralForCausalLM"]
    assert (config.num_local_experts, config.num_experts_per_tok) == (4, 2)
    assert (config.num_hidden_layers, config.num_attention_heads) == (4, 4)
    assert config.intermediate_size == 256
    assert config.vocab_size == 2048


def test_ensure_builds_atomically_then_keeps_existing(dense_model: Path, tmp_path: Path) -> None:
    out = ensure_tiny_model(tmp_path / "model")
    assert [p.name for p in tmp_path.iterdir()] == ["model"]
    assert model_digest(out) == model_digest(dense_model)
    before = _mtimes(out)
    assert ensure_tiny_model(out) == out
    assert _mtimes(out) == before
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_ensure_refuses_foreign_directory(tmp_path: Path) -> None:
    out = tmp_path / "taken"
    out.mkdir()
    (out / "notes.txt").write_text("not a model")
    with pytest.raises(FileExistsError):
        ensure_tiny_model(out)
    assert [p.name for p in tmp_path.iterdir()] == ["taken"]
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
