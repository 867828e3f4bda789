"""Does a greedy continuation give the tokens an uninterrupted run gives? Per dtype, on a bare vLLM
engine (no Ray, no tokenfab): what a migrated stream's continuation computes.

For each prompt, a greedy run of N tokens is the reference. At each resume point k, a second
request takes the prompt plus the reference's first k tokens as its prompt (computed at once, as
a continuation's is) and generates the remaining N - k; it matches when its tokens are the
reference's from k on, and the text of the first k tokens followed by its text is the reference's
text. The uninterrupted run computed those k tokens one by one; only the arithmetic differs.

    .venv/bin/python benchmarks/resume_identity.py [--dtypes float32,bfloat16]

Writes benchmarks/results/resume_identity.json and resume_identity.md, the page rendered from
the JSON alone (`markdown`): the dtypes, prompts and resume points are the records'.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

from benchmarks.common.cluster import tiny_model_dir
from benchmarks.common.results import RESULTS, write

MODEL = tiny_model_dir()
PROMPTS = ["Hello, my name is", "The capital of France", "def fib(n):", "零一二三 unicode ü",
           "river stone light market seven quiet engine paper green north window table"]
POINTS = (1, 7, 20, 40)
TOKENS = 64


def measure(dtype: str) -> dict:
    """One dtype, in this process (an engine per process)."""
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(str(MODEL), dtype=dtype, enforce_eager=True, max_model_len=2048,
              kv_cache_memory_bytes=64 << 20, enable_prefix_caching=True)
    tokenizer = llm.get_tokenizer()

    def greedy(ids: list[int], tokens: int):
        params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        return llm.generate(TokensPrompt(prompt_token_ids=ids), params,
                            use_tqdm=False)[0].outputs[0]

    cases = []
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        reference = greedy(ids, TOKENS)
        for k in POINTS:
            head = greedy(ids, k).text  # the text of the first k tokens, as streamed
            rest = greedy(ids + list(reference.token_ids[:k]), TOKENS - k)
            cases.append({"prompt": prompt, "resume_at": k,
                          "same_tokens": list(rest.token_ids) == list(reference.token_ids[k:]),
                          "same_text": head + rest.text == reference.text})
    return {"dtype": dtype, "cases": cases,
            "matching": sum(c["same_tokens"] and c["same_text"] for c in cases),
            "points": len(cases)}


def markdown(result: dict[str, Any]) -> str:
    records = result["records"]
    dtypes = ",".join(r["dtype"] for r in records)  # the only argument: the records give it
    cases = records[0]["cases"]
    prompts = len({c["prompt"] for c in cases})
    points = ", ".join(str(k) for k in dict.fromkeys(c["resume_at"] for c in cases))
    lines = ["# Greedy continuations against an uninterrupted run", "",
             f"Written by `python benchmarks/resume_identity.py --dtypes {dtypes}`: the tiny "
             f"model, {prompts} prompts, {TOKENS} tokens, resumed after {points} tokens.", "",
             "| dtype | resume points | identical | differ |", "|---|---|---|---|"]
    for r in records:
        lines.append(f"| {r['dtype']} | {r['points']} | {r['matching']} | "
                     f"{r['points'] - r['matching']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # measure one dtype, print JSON
    args = parser.parse_args()
    if args.one:
        print("RESULT " + json.dumps(measure(args.one)))
        return
    records = []
    for dtype in args.dtypes.split(","):
        out = subprocess.run([sys.executable, __file__, "--one", dtype], check=True,
                             capture_output=True, text=True).stdout
        records.append(json.loads(next(line for line in out.splitlines()
                                       if line.startswith("RESULT "))[7:]))
        print(f"{dtype}: {records[-1]['matching']}/{records[-1]['points']} identical")
    print(write(RESULTS / "resume_identity.json", {"records": records}, markdown))


if __name__ == "__main__":
    main()
