"""The cost model's check in an impl's tests: a run's record, its communication counted and predicted."""

from __future__ import annotations

import json
from pathlib import Path

from distref.cost.counts import differences

# Short runs the cost tests make: three steps, so that the counted one is steady (distref.training.traffic),
# and one evaluation of 48 samples (a cost test reads no accuracy; resnet18 scored 500 in 2x the CPU of
# its three steps).
COST_EVAL = ["--eval-samples", "48"]
COST_RUN = ["--dataset", "synthetic", "--steps", "3", "--global-batch-size", "24", *COST_EVAL]


def check_communication_predicted(out: Path, world_size: int) -> dict:
    """Every rank's counted step communicated exactly what the strategy's formula predicts (calls and
    bytes of each kind), and the counted step was the steady-state one. Returns the record."""
    record = json.loads((Path(out) / "record.json").read_text())
    communication = record["communication"]
    assert communication is not None, "the record has no communication"
    assert communication["step"] == 2, f"counted step {communication['step']}, not the steady third"
    measured, predicted = communication["measured"], communication["predicted"]
    assert predicted is not None, "the impl predicted nothing"
    assert len(measured) == len(predicted) == world_size
    assert any(m for m in measured) or world_size == 1, "nothing was counted"
    assert not differences(measured, predicted), "\n".join(differences(measured, predicted))
    return record


def check_model_states_predicted(record: dict) -> None:
    """Every rank's model-state bytes (parameters, gradients, optimizer) equal the formula's exactly."""
    measured, predicted = record["model_state_bytes"], record["model_state_bytes_predicted"]
    assert predicted is not None, "the impl predicted no model states"
    assert measured == predicted, f"measured {measured}\npredicted {predicted}"


def check_activations_predicted(record: dict) -> None:
    """Every rank's activations held for backward in the counted step equal the formula's (lenet and gpt:
    exactly, op by op; the issue's bar is 10%, and nothing here needs it)."""
    activations = record["activation_bytes"]
    measured, predicted = activations["measured"], activations["predicted"]
    assert predicted is not None and None not in predicted, "no activation formula for this run"
    assert measured == predicted, f"measured {measured}\npredicted {predicted}"


# A model of yours that trains only part of itself (frozen and unused parameters), on the example data
PARTLY_TRAINED_RUN = [
    *("--model", "distref.testing.partly_trained:mlp", "--dataset", "distref.testing.own:example_data"),
    *("--steps", "3", "--global-batch-size", "24", *COST_EVAL),
]


def check_partly_trained_predicted(record: dict, communication: bool = True) -> None:
    """A run of PARTLY_TRAINED_RUN (`record`, rank 0's): the model states (and, where `communication`, what
    each rank communicated) equal the formulas', which count gradients, optimizer state and gradient
    communication of the parameters that receive a gradient only; activations have none, and the record
    says why. Frozen and unused parameters make a difference the check can see: fewer gradient bytes
    than parameter bytes on every rank."""
    check_model_states_predicted(record)
    assert all(s["gradients"] < s["parameters"] for s in record["model_state_bytes"]), record[
        "model_state_bytes"
    ]
    if communication:
        measured, predicted = record["communication"]["measured"], record["communication"]["predicted"]
        assert predicted is not None, record["predicted_unavailable"]
        assert not differences(measured, predicted), "\n".join(differences(measured, predicted))
    assert record["activation_bytes"]["predicted"] is None
    assert record["predicted_unavailable"]["activations"].startswith("no activation formula for --model ")
