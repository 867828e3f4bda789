"""A vLLM general plugin: AMX tiles usable in every engine process of an AMX CPU.

On x86 CPUs with AMX (Sapphire Rapids and later), vLLM's CPU attention picks its AMX kernel for
bf16 with blocks of 32k tokens (`_get_attn_isa`), but Linux lets a process use AMX tile data only
after it asks (`arch_prctl(ARCH_REQ_XCOMP_PERM)`), and a spawned process starts without that
permission. oneDNN asks when its own AMX GEMMs first run; vLLM's attention kernel does not, so an
engine whose first forward pass uses no such GEMM (a prompt of a few tokens) dies of SIGILL in
`cpu_attention_with_kv_cache`. vLLM loads this plugin in every engine process (entry point
`vllm.general_plugins`) before the model runs; it asks for the permission through torch.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def register() -> None:
    import torch

    supported = getattr(torch.cpu, "_is_amx_tile_supported", None)
    if supported is None or not supported():
        return
    if not torch.cpu._init_amx():
        logger.warning("this CPU has AMX but the kernel refused its tile data to this process")
