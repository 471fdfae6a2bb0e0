"""Every model is an ordered list of named blocks with stable parameter names."""

import pytest
import torch

from distref.data import DatasetInfo
from distref.models import BlockModel, build_model
from distref.testing import count_block_calls

INFOS = {
    "lenet": DatasetInfo("mnist", 10, (1, 28, 28), "image"),
    "resnet18": DatasetInfo("cifar10", 10, (3, 32, 32), "image"),
    "gpt": DatasetInfo("synthetic", 11, (16,), "sequence"),
}
BLOCKS = {
    "lenet": ["conv1", "conv2", "fc1", "fc2"],
    "resnet18": ["stem", "layer1", "layer2", "layer3", "layer4", "head"],
    "gpt": ["embed", "block0", "block1", "head"],
}


def sample_input(name, batch=3):
    info = INFOS[name]
    if info.kind == "sequence":
        return torch.randint(0, info.num_classes, (batch, *info.input_shape))
    return torch.randn(batch, *info.input_shape)


@pytest.mark.parametrize("name", list(INFOS))
def test_model_is_an_ordered_list_of_blocks(name):
    torch.manual_seed(0)
    model = build_model(name, INFOS[name]).eval()
    assert isinstance(model, BlockModel)
    assert [n for n, _ in model.named_children()] == BLOCKS[name]
    # Applying the blocks one by one is the model: a pipeline can cut between any two of them.
    x = sample_input(name)
    h = x
    for block in model:
        h = block(h)
    torch.testing.assert_close(h, model(x), rtol=0, atol=0)
    # Every parameter belongs to exactly one block, named "<block>.<...>".
    assert all(p.split(".")[0] in BLOCKS[name] for p, _ in model.named_parameters())


@pytest.mark.parametrize("name", list(INFOS))
def test_same_seed_same_parameters_and_names(name):
    torch.manual_seed(5)
    a = build_model(name, INFOS[name]).state_dict()
    torch.manual_seed(5)
    b = build_model(name, INFOS[name]).state_dict()
    assert list(a) == list(b)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)


@pytest.mark.parametrize("name", ["lenet", "gpt"])
def test_activation_checkpointing_changes_memory_not_math(name):
    torch.manual_seed(0)
    model = build_model(name, INFOS[name])
    x = sample_input(name, batch=4)
    grads = []
    for checkpointing in (False, True):
        model.zero_grad()
        model.activation_checkpointing = checkpointing
        model(x).float().pow(2).mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for g0, g1 in zip(*grads, strict=True):
        torch.testing.assert_close(g0, g1)


def test_lenet_matches_the_classic_shape():
    model = build_model("lenet", INFOS["lenet"])
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes["conv1.0.weight"] == (10, 1, 5, 5)
    assert shapes["conv2.0.weight"] == (20, 10, 5, 5)
    assert shapes["fc1.1.weight"] == (50, 320)
    assert shapes["fc2.weight"] == (10, 50)


@pytest.mark.parametrize("name", list(INFOS))
def test_activation_checkpointing_recomputes_each_block_once_in_backward(name):
    torch.manual_seed(0)
    model = build_model(name, INFOS[name])
    calls = count_block_calls(model)
    model(sample_input(name)).float().sum().backward()
    assert set(calls.values()) == {1}  # plain: one forward per block
    model.activation_checkpointing = True
    model(sample_input(name)).float().sum().backward()
    assert set(calls.values()) == {3}  # + a forward and its recomputation
    with torch.no_grad():  # evaluation stores nothing for backward: no checkpointing, no recompute
        model(sample_input(name))
    assert set(calls.values()) == {4}


def test_activation_checkpointing_updates_batchnorm_statistics_once():
    """The recomputed forward must not update BatchNorm's running statistics a second time."""
    states = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = build_model("resnet18", INFOS["resnet18"])
        model.activation_checkpointing = checkpointing
        for step in range(2):
            torch.manual_seed(step)
            model(sample_input("resnet18", batch=4)).sum().backward()
        states.append(model.state_dict())
    plain, checkpointed = states
    assert int(checkpointed["stem.1.num_batches_tracked"]) == 2
    for key in plain:  # every buffer and parameter, bitwise
        assert torch.equal(plain[key], checkpointed[key]), key


def test_the_batchnorm_context_can_be_entered_again():
    """Split backward (zero-bubble schedules) recomputes a block twice through the same context object:
    each entry keeps the statistics as they were at that entry."""
    from distref.models import BatchNormStatisticsKept

    norm = torch.nn.BatchNorm1d(3)
    kept = BatchNormStatisticsKept(norm)
    for entry in range(2):
        norm(torch.randn(4, 3))  # outside the context, the update stays
        assert int(norm.num_batches_tracked) == entry + 1
        before = [b.clone() for b in norm.buffers()]
        with kept:
            norm(torch.randn(4, 3))
        assert all(torch.equal(a, b) for a, b in zip(before, norm.buffers(), strict=True))


def test_gpt_layers_sets_the_depth():
    """--gpt-layers N: embed, N transformer blocks, head; the residual projections' init shrinks with depth
    (GPT-2: std 0.02 / sqrt(2N)), and the partition says which depth fits a number of parts."""
    from distref.distributed.partition import choose_cut_points, named_block_sizes

    torch.manual_seed(0)
    model = build_model("gpt", INFOS["gpt"], gpt_layers=6)
    assert [n for n, _ in model.named_children()] == ["embed", *(f"block{i}" for i in range(6)), "head"]
    assert model(sample_input("gpt")).shape == (3, 16, 11)
    std = model.get_submodule("block5.attn.proj").weight.std().item()
    assert std == pytest.approx(0.02 / 12**0.5, rel=0.1)
    assert list(named_block_sizes("gpt", 6)) == [n for n, _ in model.named_children()]
    assert choose_cut_points(named_block_sizes("gpt", 6), None, 8, "gpt") == ([1, 2, 3, 4, 5, 6, 7], None)
    assert choose_cut_points(named_block_sizes("gpt"), None, 8, "gpt")[1] == (
        "8 parts but --model gpt has only 4 blocks (gpt has --gpt-layers + 2: use --gpt-layers 6)"
    )
