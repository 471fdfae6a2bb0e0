"""What each strategy costs, by formula: communication per rank and step (one module per strategy
family: `data_parallel`, `sharded`, `zero`, `tensor_parallel`, `pipeline`; their shared rules in
`counts`), model-state bytes per rank (`memory`) and activations held for backward (`activations`).

Every formula here is checked against measurement: the impls put both in their record.json
(`communication.measured` / `predicted`, `model_state_bytes`, `activation_bytes`) and the tests require them
equal (docs/cost-model.md). The formulas take shapes, not tensors, so they answer for models too large to
build — the planner's case.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Predicted:
    """What the formulas say one rank costs: `communication` in one optimizer step ({kind: {"calls",
    "bytes", "bus_bytes"}}), `model_states` ({"parameters", "gradients", "optimizer"} bytes) and
    `activations` (bytes held for backward at most); None where there is no formula."""

    communication: dict[str, dict[str, float]] | None = None
    model_states: dict[str, int] | None = None
    activations: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
