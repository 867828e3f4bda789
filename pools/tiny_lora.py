"""Deterministic LoRA adapters for the tiny model, written in PEFT's on-disk format directly.

Adapter `i` of a base model is a function of the base's config and `i` alone: the same inputs
give byte-identical files, and adapters differ enough to change greedy output.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
RANK, ALPHA = 8, 16
_SEED_BASE = 1_000_003  # adapter i draws from seed _SEED_BASE + i, apart from the base's seeds


def adapter_name(index: int) -> str:
    """The name `tokenfab model tiny --lora N` gives adapter `index` (0-based): lora-0, lora-1..."""
    return f"lora-{index}"


def _shapes(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(in, out) features of each target projection of a Llama decoder layer."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
            "o_proj": (q, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}


def _module_path(name: str) -> str:
    return f"self_attn.{name}" if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) \
        else f"mlp.{name}"


def build_tiny_adapter(base: Path, out: Path, index: int) -> Path:
    """Write adapter `index` for the dense tiny model at `base` into `out`."""
    config = json.loads((Path(base) / "config.json").read_text())
    if config.get("model_type") != "llama":
        raise ValueError(f"{base}: tiny adapters are made for the dense tiny model (llama); "
                         f"this one is {config.get('model_type')!r}")
    shapes, tensors = _shapes(config), {}
    generator = torch.Generator().manual_seed(_SEED_BASE + index)
    for layer in range(config["num_hidden_layers"]):
        for name in TARGET_MODULES:
            fan_in, fan_out = shapes[name]
            prefix = f"base_model.model.model.layers.{layer}.{_module_path(name)}"
            # B is not zero, as training would leave it: the adapter must change the output
            a = torch.randn(RANK, fan_in, generator=generator) / fan_in ** 0.5
            b = torch.randn(fan_out, RANK, generator=generator) * 0.05
            tensors[f"{prefix}.lora_A.weight"] = a.to(torch.bfloat16).contiguous()
            tensors[f"{prefix}.lora_B.weight"] = b.to(torch.bfloat16).contiguous()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": ALPHA,
        "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
        "target_modules": list(TARGET_MODULES), "base_model_name_or_path": str(base),
    }
    (out / CONFIG_FILE).write_text(json.dumps(adapter_config, indent=2, sort_keys=True) + "\n")
    for file in out.iterdir():
        file.chmod(0o644)
    return out


def ensure_tiny_adapter(base: Path, out: Path, index: int) -> Path:
    """Return `out` untouched if it holds an adapter, else build adapter `index` there
    atomically (replicas starting together may race for it)."""
    out = Path(out)
    if (out / CONFIG_FILE).is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        build_tiny_adapter(base, tmp, index)
        tmp.chmod(0o755)
        try:
            tmp.rename(out)
        except OSError:
            if not (out / CONFIG_FILE).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
