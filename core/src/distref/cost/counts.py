"""Communication as the formulas state it and the record stores it: per rank, kind → {"calls", "bytes",
"bus_bytes"} for one optimizer step (the same shape distref.training.traffic measures)."""

from __future__ import annotations

import math
from collections.abc import Iterable

Counts = dict[str, dict[str, float]]

# nccl-tests' bus bandwidth (doc/PERFORMANCE.md): what one rank of n moves over its links per byte of
# message — 2(n-1)/n for all-reduce (a reduce-scatter then an all-gather), (n-1)/n for all-gather,
# reduce-scatter and all-to-all, the message itself for broadcast, reduce, send and recv.
BUS_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
}


def bus_bytes(kind: str, message_bytes: int, group_size: int) -> float:
    factor = BUS_FACTORS.get(kind)
    return message_bytes * factor(group_size) if factor and group_size > 0 else float(message_bytes)


def add(counts: Counts, kind: str, message_bytes: int, group_size: int, calls: int = 1) -> Counts:
    """Add `calls` operations of `kind` moving `message_bytes` in all (in a group of `group_size`)."""
    if calls == 0:
        return counts
    entry = counts.setdefault(kind, {"calls": 0, "bytes": 0, "bus_bytes": 0.0})
    entry["calls"] += calls
    entry["bytes"] += message_bytes
    entry["bus_bytes"] += bus_bytes(kind, message_bytes, group_size)
    return counts


def merge(*parts: Counts) -> Counts:
    total: Counts = {}
    for part in parts:
        for kind, entry in part.items():
            into = total.setdefault(kind, {"calls": 0, "bytes": 0, "bus_bytes": 0.0})
            for key, value in entry.items():
                into[key] += value
    return total


def same(measured: Counts | None, predicted: Counts | None) -> bool:
    """Calls and bytes equal exactly; bus bytes to float rounding (they are sums of fractions)."""
    measured, predicted = measured or {}, predicted or {}
    if measured.keys() != predicted.keys():
        return False
    return all(
        measured[k]["calls"] == predicted[k]["calls"]
        and measured[k]["bytes"] == predicted[k]["bytes"]
        and math.isclose(measured[k].get("bus_bytes", 0.0), predicted[k].get("bus_bytes", 0.0), rel_tol=1e-9)
        for k in measured
    )


def differences(measured: list[Counts | None], predicted: list[Counts | None]) -> list[str]:
    """One line per rank whose counts differ (for an assertion message)."""
    return [
        f"rank {rank}: measured {m} predicted {p}"
        for rank, (m, p) in enumerate(zip(measured, predicted, strict=True))
        if not same(m, p)
    ]


def buckets(sizes: Iterable[int], limits: list[int]) -> list[int]:
    """Greedy bucketing as DDP's reducer does it (compute_bucket_assignment_by_size in reducer.cpp):
    tensors in order fill a bucket until it reaches the current limit; the first bucket's limit is
    `limits[0]`, every later one `limits[-1]`. Returns each bucket's size."""
    result, current, limit_index = [], 0, 0
    for size in sizes:
        current += size
        if current >= limits[limit_index]:
            result.append(current)
            current, limit_index = 0, min(limit_index + 1, len(limits) - 1)
    if current:
        result.append(current)
    return result
