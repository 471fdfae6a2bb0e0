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


# ---- gpt as a mixture of experts (--experts) -----------------------------------------------------------

TOKENS = DatasetInfo("synthetic", 11, (16,), "sequence")


def moe_gpt(experts: int = 4, top_k: int = 2, sequences: int = 8, dtype=torch.float64):
    from distref.config import MoEConfig

    torch.manual_seed(0)
    return build_model("gpt", TOKENS, 2, dtype, MoEConfig(experts, top_k, 0.01, sequences))


def test_moe_gpt_has_experts_in_each_block_under_names_every_impl_shares():
    model = moe_gpt()
    names = {n: tuple(p.shape) for n, p in model.named_parameters() if "mlp" in n}
    assert names == {
        f"block{i}.mlp.{n}": shape
        for i in range(2)
        for n, shape in {
            "router.weight": (4, 64),
            "experts.w1": (4, 64, 256),
            "experts.b1": (4, 256),
            "experts.w2": (4, 256, 64),
            "experts.b2": (4, 64),
        }.items()
    }
    assert list(model.state_dict()) == [n for n, _ in model.named_parameters()]  # no key twice


@pytest.mark.parametrize("top_k", [1, 2])
def test_each_token_is_the_weighted_sum_of_its_top_k_experts(top_k):
    """The definition, token by token: softmax router, the k largest probabilities (renormalised for
    k > 1, the probability itself for k = 1), each chosen expert's MLP (D → 4D → GELU → D)."""
    from distref.models import MoE

    model = moe_gpt(top_k=top_k)
    moe = model.block0.mlp
    assert isinstance(moe, MoE)
    x = torch.randn(3, 5, 64, dtype=torch.float64)
    out = moe(x)
    e = moe.experts
    for b in range(3):
        for t in range(5):
            token = x[b, t]
            probs = torch.softmax(moe.router.weight @ token, dim=-1)
            weights, chosen = probs.topk(top_k)
            if top_k > 1:
                weights = weights / weights.sum()
            expected = sum(
                w * (torch.nn.functional.gelu(token @ e.w1[i] + e.b1[i]) @ e.w2[i] + e.b2[i])
                for w, i in zip(weights, chosen.tolist(), strict=True)
            )
            assert torch.allclose(out[b, t], expected, atol=1e-12)


def test_a_token_computes_the_same_whatever_batch_it_is_in():
    """Dropless: no capacity, no token dropped, so a sequence's output does not depend on the others in its
    batch (any split over ranks or micro-batches computes the same function), nor does its routing."""
    model = moe_gpt()
    x = torch.randint(0, 11, (8, 16))
    whole = model(x)
    for part in (x[:3], x[3:4], x[4:]):
        start = next(i for i in range(8) if torch.equal(x[i], part[0]))
        assert torch.allclose(model(part), whole[start : start + len(part)], rtol=0, atol=1e-12)


def test_the_balance_loss_is_each_sequences_term_so_micro_batches_add_up_to_the_batch():
    """The load-balancing loss's gradient, reached through the layer's output (AddToLoss), summed over
    micro-batches equals the whole batch's: each sequence's Switch term α·E·Σ f_i·P_i, ÷ the global batch.
    The same loss over the whole batch's tokens at once (Switch's per-batch form) would not add up."""
    model = moe_gpt()
    x = torch.randint(0, 11, (8, 16))
    router = model.block0.mlp.router.weight

    def router_grad(parts):
        model.zero_grad()
        for part in parts:
            model(part).sum().mul(0).backward()  # (the task loss's gradient zero: the balance loss's alone)
        return router.grad.clone()

    whole = router_grad([x])
    assert whole.abs().max() > 0  # the balance loss reaches the router
    assert torch.allclose(router_grad([x[:2], x[2:5], x[5:]]), whole, rtol=0, atol=1e-15)


def test_the_balance_loss_value_is_switchs_per_sequence():
    """α·E·Σ_i f_i·P_i for each sequence (f: its fraction of the token choices per expert, P: its mean
    router probability per expert), summed and ÷ the global batch's 8 sequences."""
    from distref.models import ROUTING

    model = moe_gpt(sequences=8)
    moe = model.block0.mlp
    x = torch.randn(2, 16, 64, dtype=torch.float64)
    ROUTING.take()
    moe(x)
    counts, balance = ROUTING.take()
    probs = torch.softmax(x @ moe.router.weight.T, dim=-1)  # (2, 16, 4)
    chosen = probs.topk(2, dim=-1).indices
    expected = 0.0
    for s in range(2):
        f = torch.bincount(chosen[s].flatten(), minlength=4) / (16 * 2)
        expected += 0.01 * 4 * (f * probs[s].mean(0)).sum() / 8
    assert torch.allclose(balance, expected, atol=1e-15)
    assert counts.tolist() == [torch.bincount(chosen.flatten(), minlength=4).tolist()]


def test_the_routing_log_counts_training_forwards_once_not_evaluation_nor_recomputation():
    from distref.models import ROUTING

    model = moe_gpt()
    x = torch.randint(0, 11, (4, 16))
    ROUTING.take()
    with torch.no_grad():
        model(x)
    assert ROUTING.take() is None  # evaluation
    model.activation_checkpointing = True
    model(x).sum().backward()
    counts, _ = ROUTING.take()
    assert counts.sum(dim=1).tolist() == [4 * 16 * 2] * 2  # one forward per layer, not two


@pytest.mark.parametrize(
    "options",
    [[], ["--top-k", "1"], ["--precision", "bf16"], ["--precision", "fp64", "--grad-accum", "2"]],
    ids=["fp32", "top-1", "bf16", "fp64-accum2"],
)
def test_single_with_experts_holds_the_activations_and_model_states_the_formulas_say(
    options, single_train, tmp_path
):
    """distref.cost.activations.moe_layer_bytes, op by op (the router, the dispatch, each expert's rows and
    hidden, the combine; under bf16 each expert's weight casts), exact against what autograd saved."""
    from distref.record import load_record
    from distref.testing import COST_RUN, check_activations_predicted, check_model_states_predicted

    single_train.main(["--model", "gpt", *COST_RUN, "--experts", "4", *options, "--out", str(tmp_path)])
    record = load_record(tmp_path)
    check_activations_predicted(record)
    check_model_states_predicted(record)


def test_single_with_experts_compiles_with_activation_checkpointing(single_train, tmp_path, monkeypatch):
    """--compile with --activation-checkpointing: the MoE layer runs eagerly (its groups' sizes are the
    routing's), the rest compiled; compiled, its recomputation went through another graph and
    checkpointing refused it at step 0. The run trains, its graphs counted, its activations as predicted."""
    from distref.record import load_record
    from distref.testing import COST_RUN, check_activations_predicted

    monkeypatch.setenv("DISTREF_COMPILE_BACKEND", "aot_eager")
    args = ["--model", "gpt", *COST_RUN, "--experts", "4", "--compile", "--activation-checkpointing"]
    single_train.main([*args, "--out", str(tmp_path)])
    record = load_record(tmp_path)
    assert record["status"] == "completed" and record["strategy"]["compiled_graphs"] > 0
    check_activations_predicted(record)
