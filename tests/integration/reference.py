"""Greedy outputs of a bare vLLM engine (no Ray, no tokenfab) for the equality tests.

Run as a script: `python reference.py TOPOLOGY OUT.json`; prompts come from cases.py.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")


def _record(outputs: list) -> dict:
    [output] = outputs
    completion = output.outputs[0]
    return {"prompt_token_ids": output.prompt_token_ids, "token_ids": list(completion.token_ids),
            "text": completion.text}


def main(topology_path: str, out: str) -> None:
    from vllm import LLM, SamplingParams

    from orchestrator.config import load_topology
    from tests.integration.cases import CHATS, FALLBACK, PROMPTS

    topology = load_topology(topology_path)
    pool = topology.pools[0]
    model = topology.model_of(pool)
    lora = model.lora
    lora_args = {} if lora is None else {
        "enable_lora": True, "max_loras": lora.max_loras, "max_cpu_loras": lora.resident,
        "max_lora_rank": lora.max_rank}
    llm = LLM(
        model=model.resolved_path,
        dtype=model.dtype,
        max_model_len=model.max_model_len,
        kv_cache_memory_bytes=pool.resources.kv_cache_bytes,
        enable_prefix_caching=True,
        **lora_args,
        **(topology.engine_args | pool.engine_args),
    )

    def greedy(max_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=max_tokens)

    results = {
        "prompts": [_record(llm.generate([c.prompt], greedy(c.max_tokens), use_tqdm=False))
                    for c in PROMPTS],
        "chats": [_record(llm.chat([c.messages], greedy(c.max_tokens), use_tqdm=False))
                  for c in CHATS],
        "fallback": _record(llm.generate([FALLBACK.prompt], greedy(FALLBACK.max_tokens),
                                         use_tqdm=False)),
    }
    if lora is not None:  # each declared adapter's outputs, with vLLM's own LoRARequest
        results["adapters"] = adapter_outputs(llm, model, greedy)
    with open(out, "w") as f:
        json.dump(results, f)


def adapter_outputs(llm, model, greedy) -> dict:
    from pathlib import Path

    from vllm.lora.request import LoRARequest

    from pools.tiny_lora import ensure_tiny_adapter
    from tests.integration.cases import PROMPTS

    outputs = {}
    for number, adapter in enumerate(model.adapters, start=1):
        if adapter.generate is not None:
            ensure_tiny_adapter(Path(model.resolved_path), Path(adapter.resolved_path),
                                adapter.generate)
        request = LoRARequest(adapter.name, number, adapter.resolved_path)
        outputs[adapter.name] = [
            _record(llm.generate([c.prompt], greedy(c.max_tokens), lora_request=request,
                                 use_tqdm=False)) for c in PROMPTS]
    return outputs


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
