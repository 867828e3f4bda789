"""Repeated runs of one benchmark point: the median and range of each figure, a verdict that calls
a difference a win or a loss only when the ranges are apart, and goodput at a latency target.

On this machine the same setup's timings swing 2-4x between runs, so one run decides nothing:
each (system, policy, load) is replayed several times and every figure is reported as the median
of the runs with their min-max range.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any


def aggregate(records: list[dict[str, Any]], keys: Sequence[str],
              fields: Sequence[str]) -> list[dict[str, Any]]:
    """One row per distinct `keys`, in first-seen order: the keys, `repeats`, each of `fields` as
    the median of the runs that have it, `<field>_range` as [min, max], and `runs` (the records).

    Example: two runs with ttft_p90_s 0.10 and 0.30 -> ttft_p90_s 0.20, range [0.10, 0.30]."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for record in records:
        groups.setdefault(tuple(record[k] for k in keys), []).append(record)
    rows = []
    for group, runs in groups.items():
        row: dict[str, Any] = dict(zip(keys, group)) | {"repeats": len(runs)}
        for field in fields:
            values = [r[field] for r in runs if r.get(field) is not None]
            row[field] = statistics.median(values) if values else None
            row[f"{field}_range"] = [min(values), max(values)] if values else None
        rows.append(row | {"runs": runs})
    return rows


def verdict(ours: dict[str, Any], theirs: dict[str, Any], field: str,
            lower_is_better: bool = True) -> str:
    """"win" or "loss" where the two rows' ranges of `field` do not overlap, else "tie"."""
    (low, high), (their_low, their_high) = ours[f"{field}_range"], theirs[f"{field}_range"]
    if high < their_low:
        return "win" if lower_is_better else "loss"
    if low > their_high:
        return "loss" if lower_is_better else "win"
    return "tie"


def goodput(points: list[tuple[float, float | None, int]], slo_s: float
            ) -> tuple[float, bool]:
    """The highest rate at which TTFT p90 <= `slo_s` with no failed request, from one run's
    (rate, TTFT p90, failed) points; and whether it is only a lower bound (every rate met it).

    Rates are taken in increasing order and the first that misses the target ends the search: the
    goodput lies between the last rate that met it and that one, found by linear interpolation of
    the TTFT p90 between them (a failed request puts the goodput at the last rate met). Below the
    lowest rate nothing was measured: a miss there gives 0.

    Example: points (2, 0.05, 0), (4, 0.10, 0), (8, 0.50, 0) and a target of 0.20 s -> the p90
    crosses 0.20 s a quarter of the way from 4 to 8: 5.0 req/s."""
    met_rate, met_p90 = 0.0, None
    for rate, p90, failed in sorted(points, key=lambda p: p[0]):
        if p90 is None or failed:
            return met_rate, False
        if p90 > slo_s:
            if met_p90 is None:
                return 0.0, False
            share = (slo_s - met_p90) / (p90 - met_p90)
            return met_rate + share * (rate - met_rate), False
        met_rate, met_p90 = rate, p90
    return met_rate, True
