"""The AMX plugin: registered for vLLM's engine processes, and a process that runs it may use
AMX tile data (on a CPU without AMX it does nothing). Without the permission, vLLM's AMX attention
kernel dies of SIGILL on an engine's first short prompt (seen on a Sapphire Rapids VM)."""

from __future__ import annotations

import ctypes
import multiprocessing
from importlib.metadata import entry_points

ARCH_GET_XCOMP_PERM = 0x1022
XFEATURE_XTILEDATA = 18
SYS_ARCH_PRCTL = 158  # x86-64


def _tile_data_permitted() -> bool:
    mask = ctypes.c_uint64(0)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(SYS_ARCH_PRCTL, ARCH_GET_XCOMP_PERM, ctypes.byref(mask)) != 0:
        return False
    return bool(mask.value >> XFEATURE_XTILEDATA & 1)


def _child(queue) -> None:  # a fresh process, as vLLM spawns its workers
    import torch

    from pools.cpu_isa import register

    before = _tile_data_permitted()
    register()
    queue.put((torch.cpu._is_amx_tile_supported(), before, _tile_data_permitted()))


def test_plugin_is_registered_with_vllm() -> None:
    plugins = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert plugins["tokenfab_cpu_isa"] == "pools.cpu_isa:register"


def test_a_spawned_process_may_use_amx_after_the_plugin() -> None:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_child, args=(queue,))
    process.start()
    amx, before, after = queue.get(timeout=120)
    process.join(30)
    assert after == amx  # permitted exactly where the CPU has AMX
    assert not before or after
