"""Tests for exclusive per-process core claims (file locks in a temporary lock directory)."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterator
from multiprocessing.synchronize import Event
from pathlib import Path

import pytest

from pools.cores import CoreClaim, claim_cores

CORES = sorted(os.sched_getaffinity(0))


@pytest.fixture
def claims() -> Iterator[list[CoreClaim]]:
    """Claims made by a test, released afterwards even when it fails."""
    held: list[CoreClaim] = []
    yield held
    for claim in held:
        claim.release()


def claim(lock_dir: Path, count: int, held: list[CoreClaim]) -> CoreClaim | None:
    got = claim_cores(count, lock_dir)
    if got is not None:
        held.append(got)
    return got


def test_claims_in_one_process_exclude_each_other(tmp_path: Path, claims: list[CoreClaim]) -> None:
    # flock locks belong to the open file description, so a second open in the same process conflicts.
    singles = [claim(tmp_path, 1, claims) for _ in CORES]
    assert [c.cores for c in singles if c] == [[core] for core in CORES]
    assert claim(tmp_path, 1, claims) is None


def test_claim_all_cores_at_once(tmp_path: Path, claims: list[CoreClaim]) -> None:
    whole = claim(tmp_path, len(CORES), claims)
    assert whole is not None
    assert (whole.cores, whole.omp_bind_ranks(1)) == (CORES, ",".join(map(str, CORES)))
    assert claim(tmp_path, 1, claims) is None


def test_failed_claim_keeps_nothing(tmp_path: Path, claims: list[CoreClaim]) -> None:
    assert claim(tmp_path, len(CORES) + 1, claims) is None
    assert claim(tmp_path, len(CORES), claims) is not None


def test_release_frees_the_core(tmp_path: Path, claims: list[CoreClaim]) -> None:
    first, *_ = [claim(tmp_path, 1, claims) for _ in CORES]
    assert first is not None and claim(tmp_path, 1, claims) is None
    first.release()
    first.release()  # a second release is harmless
    again = claim(tmp_path, 1, claims)
    assert again is not None and again.cores == first.cores == [CORES[0]]


def _hold_one_core(lock_dir: Path, claimed: Event, done: Event) -> None:
    """Child process: claim a core and keep it, without release, until told to exit."""
    held = claim_cores(1, lock_dir)
    assert held is not None
    claimed.set()
    done.wait(timeout=30)


def test_child_claim_holds_until_child_exits(tmp_path: Path, claims: list[CoreClaim]) -> None:
    spawn = multiprocessing.get_context("spawn")
    claimed, done = spawn.Event(), spawn.Event()
    child = spawn.Process(target=_hold_one_core, args=(tmp_path, claimed, done))
    child.start()
    try:
        assert claimed.wait(timeout=30)
        assert claim(tmp_path, len(CORES), claims) is None
    finally:
        done.set()
        child.join(timeout=30)
    assert child.exitcode == 0
    assert claim(tmp_path, len(CORES), claims) is not None


def test_cores_split_across_an_engines_ranks() -> None:
    """vLLM's CPU workers take their cores from VLLM_CPU_OMP_THREADS_BIND, one `|` group per
    rank (tensor x data), in rank order."""
    whole = CoreClaim([4, 5, 6, 7], [])
    assert whole.omp_bind_ranks(1) == "4,5,6,7"
    assert whole.omp_bind_ranks(2) == "4,5|6,7"
    assert whole.omp_bind_ranks(4) == "4|5|6|7"
    with pytest.raises(ValueError, match="do not split evenly across 3 ranks"):
        whole.omp_bind_ranks(3)
