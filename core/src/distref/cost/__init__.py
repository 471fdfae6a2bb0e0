"""What each strategy costs, by formula: communication per rank and step (one module per strategy
family: `data_parallel`, `sharded`, `zero`, `tensor_parallel`, `pipeline`; their shared rules in
`counts`), model-state bytes per rank (`memory`) and activations held for backward (`activations`).

Every formula here is checked against measurement: the impls put both in their record.json
(`communication.measured` / `predicted`, `model_state_bytes`, `activation_bytes`) and the tests require them
equal (docs/cost-model.md). The formulas take shapes, not tensors, so they answer for models too large to
build — the planner's case; and, where a model trains only part of itself (frozen or unused parameters),
which parameters receive a gradient (`usage`: one step of the model on the meta device).
"""

from __future__ import annotations

import dataclasses
from typing import Any

FORMULAS = ("communication", "model_states", "activations")  # what Predicted predicts


@dataclasses.dataclass(frozen=True)
class Predicted:
    """What the formulas say one rank costs: `communication` in one optimizer step ({kind: {"calls",
    "bytes", "bus_bytes"}}), `model_states` ({"parameters", "gradients", "optimizer"} bytes) and
    `activations` (bytes held for backward at most); None where there is no formula. `unavailable` says
    why, in a line, for each one left None (the record's `predicted_unavailable`): give the reason each
    would have none (None for no reason); those of predictions made are dropped."""

    communication: dict[str, dict[str, float]] | None = None
    model_states: dict[str, int] | None = None
    activations: int | None = None
    unavailable: dict[str, str | None] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        reasons = {name: why for name, why in self.unavailable.items() if why and getattr(self, name) is None}
        # A null prediction without its reason reads as a formula forgotten: refused
        if missing := [name for name in FORMULAS if getattr(self, name) is None and name not in reasons]:
            raise ValueError(f"no formula for {', '.join(missing)}, and no reason given")
        object.__setattr__(self, "unavailable", reasons)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
