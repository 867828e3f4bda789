"""The one percentile every figure of the project uses: NumPy's default, linear interpolation
between the two nearest ranks (Hyndman and Fan's definition 7; the median is its 50th).

Results files, the simulator's reports and the benchmarks all compute p50/p90/p99 through it, so
their numbers compare. `docs/benchmarks.md` names it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt


def percentile(values: Sequence[float] | npt.NDArray[np.floating], q: float) -> float:
    """The q-th percentile (0-100) of `values`; NaN when there are none."""
    return float(np.percentile(values, q)) if len(values) else float("nan")


def percentile_or_none(values: Sequence[float] | npt.NDArray[np.floating], q: float
                       ) -> float | None:
    """`percentile`, or None where there are no values (results are JSON, which has no NaN)."""
    return percentile(values, q) if len(values) else None
