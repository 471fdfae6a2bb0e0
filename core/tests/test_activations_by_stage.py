"""distref.cost.activations block by block, in one process, against what autograd saves: every block of
lenet, resnet18 and gpt run as a pipeline stage alone (its input received, so it needs a gradient), each
held byte counted by the saved-tensor meter the runs use, after the forward and after torch's split
backward's input-gradient pass (`stage_backward_input`), then after its weight-gradient pass. The
schedules' order of that work, multi-process: impls/pipeline's test_cost_equals_the_formulas."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from distref.cost.activations import Held, formula_for, held_in_order, stage_bytes, stage_holdings
from distref.data.tensors import DatasetInfo
from distref.models import build_model
from distref.training.measure import SavedActivations
from distref.training.steps import loss_fn

MICRO_BATCH = 3
INFOS = {  # small inputs: the formulas take any image size and sequence length
    "lenet": DatasetInfo("mnist", 10, (1, 28, 28), "image"),
    "resnet18": DatasetInfo("small-images", 10, (3, 12, 12), "image"),
    "gpt": DatasetInfo("tokens", 11, (8,), "sequence"),
}


def stage_input(model, info: DatasetInfo, first: int) -> torch.Tensor:
    """What stage `first` receives: the earlier blocks' output on a micro-batch, as a fresh tensor that
    needs a gradient (a pipeline stage's received activation)."""
    torch.manual_seed(0)
    if info.kind == "sequence":
        x = torch.randint(info.num_classes, (MICRO_BATCH, *info.input_shape))
    else:
        x = torch.randn(MICRO_BATCH, *info.input_shape)
    with torch.no_grad():
        for block in list(model)[:first]:
            x = block(x)
    return x.requires_grad_(x.is_floating_point())


def targets(info: DatasetInfo) -> torch.Tensor:
    shape = (MICRO_BATCH, *info.input_shape) if info.kind == "sequence" else (MICRO_BATCH,)
    return torch.randint(info.num_classes, shape)


CASES = [(name, index) for name in INFOS for index in range({"lenet": 4, "resnet18": 6, "gpt": 4}[name])]


@pytest.mark.parametrize("name, index", CASES)
def test_each_block_as_a_stage_holds_what_the_formula_says_through_a_split_backward(name, index):
    """Each block alone as a stage (the last with the loss): bytes saved after its forward, still held
    after the input-gradient pass, and nothing after the weight-gradient pass, exactly."""
    info = INFOS[name]
    model = build_model(name, info)
    model.train()
    blocks, loss = formula_for(name, info, gpt_layers=2, precision="fp32", checkpointed=False)
    last_stage = index == len(blocks) - 1
    its_loss = loss if last_stage else None
    holdings = stage_holdings(blocks[index : index + 1], its_loss, MICRO_BATCH, index, False, 0)
    saved_once = blocks[index].once  # BatchNorm's running statistics: buffers, not counted per micro-batch

    x = stage_input(model, info, index)
    block = list(model)[index]
    meter = SavedActivations(model.parameters())
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
        out = block(x)
        if last_stage:
            out = loss_fn(out, targets(info))
    assert meter.live == sum(h.bytes for h in holdings) + saved_once
    assert meter.live == stage_bytes(blocks[index : index + 1], its_loss, MICRO_BATCH)

    if index == 0:  # the first stage: no input gradient (torch runs its whole backward at "W")
        return
    grads = None if last_stage else [torch.ones_like(out)]
    _, param_groups = stage_backward_input([out], grads, [x], block.parameters())
    kept_for_weights = sum(h.bytes for h in holdings if h.until == "W")
    assert meter.live == kept_for_weights + saved_once
    stage_backward_weight(block.parameters(), param_groups)
    assert meter.live == 0
    assert all(p.grad is not None for p in block.parameters())


def test_a_tensor_two_stages_save_counts_once_until_both_let_go():
    """Stages 1 and 2 on one rank (a V schedule's turn): stage 1 lets go of its output at its "I", stage 2
    of the same tensor, its input, at its "W"; each micro-batch's counts once while either holds it."""
    stage1 = [Held("kept by 1", 1000, "W"), Held("1->2", 10, "I")]
    stage2 = [Held("1->2", 10, "W"), Held("kept by 2", 1, "W")]
    holdings = {1: stage1, 2: stage2}
    forwards = [("F", 1, 0), ("F", 2, 0)]
    assert held_in_order(forwards, holdings) == 1011
    # The next micro-batch's forward on stage 1 (1010) comes after some of micro-batch 0's passes: the
    # shared tensor goes with the later of stage 1's "I" and stage 2's "W", in either order
    next_forward = [("F", 1, 1)]
    assert held_in_order([*forwards, ("I", 2, 0), ("I", 1, 0), *next_forward], holdings) == 1011 + 1010
    assert held_in_order([*forwards, ("W", 2, 0), *next_forward], holdings) == 1010 + 1010
    assert held_in_order([*forwards, ("I", 1, 0), ("W", 2, 0), *next_forward], holdings) == 1000 + 1010
    assert held_in_order([*forwards, ("W", 2, 0), ("I", 1, 0), *next_forward], holdings) == 1000 + 1010
    assert held_in_order([*forwards, ("B", 2, 0), ("B", 1, 0), *next_forward], holdings) == 1011
    with pytest.raises(ValueError, match="unknown action"):
        held_in_order([("X", 1, 0)], holdings)


def test_a_split_backward_keeps_the_weights_inputs_until_the_weight_pass():
    """One stage, two micro-batches: "I" lets go of what lies after the weights, "W" of the rest."""
    holdings = {3: [Held("kept by 3", 1000, "W"), Held("after the weights of 3", 10, "I")]}
    order = [("F", 3, 0), ("I", 3, 0), ("F", 3, 1), ("W", 3, 0), ("I", 3, 1), ("W", 3, 1)]
    assert held_in_order(order, holdings) == 1000 + 1010
    assert held_in_order([("F", 3, 0), ("B", 3, 0), ("F", 3, 1)], holdings) == 1010
