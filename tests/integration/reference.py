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
    llm = LLM(
        model=topology.model.resolved_path,
        dtype=topology.model.dtype,
        max_model_len=topology.model.max_model_len,
        kv_cache_memory_bytes=pool.resources.kv_cache_bytes,
        enable_prefix_caching=True,
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
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
