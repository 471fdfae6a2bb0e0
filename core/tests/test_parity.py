"""The parity oracle's rules (distref.parity): which single run each case is compared with, and how close."""

import pytest

from distref.compare import DEFAULT_WORKLOAD
from distref.config import with_defaults
from distref.impl_folders import discover, validate
from distref.parity import (
    FP32_TOLERANCE,
    FP64_TOLERANCE,
    SHORT_STEPS,
    exact_oracle,
    oracle,
    parity_settings,
    render,
    shortened,
)
from distref.testing import ROOT

IMPLS = discover(ROOT / "impls")


def settings(impl: str) -> dict:
    return parity_settings(ROOT / "impls" / impl)


@pytest.mark.parametrize(
    ("impl", "world", "accum", "precision", "optimizer", "expected"),
    [
        ("ddp", 3, 2, "fp64", "adamw", (1, FP64_TOLERANCE)),  # fp64: plain single, any split
        ("ddp", 3, 1, "fp32", "sgd", (1, FP32_TOLERANCE)),  # SGD does not amplify rounding
        ("ddp", 2, 2, "fp32", "adamw", (4, FP32_TOLERANCE)),  # each rank sums its slice: 2 × 2 sums
        ("pipeline", 3, 4, "fp32", "adamw", (4, FP32_TOLERANCE)),  # every stage sees the whole batch: M sums
        ("model_parallel", 3, 2, "fp32", "adamw", (2, FP32_TOLERANCE)),
    ],
)
def test_the_oracle_makes_the_same_sums(impl, world, accum, precision, optimizer, expected):
    assert oracle(impl, settings(impl), world, accum, precision, optimizer) == expected


def test_tensor_parallel_has_no_fp32_adamw_oracle_and_trains_gpt_in_the_matrix():
    """Its row-wise layers sum partial products across ranks: no single run sums the same way, so fp32
    AdamW is checked in fp64; SGD against plain single. Its matrix rows train gpt, not the lenet workload."""
    tp = settings("tensor_parallel")
    reference, why = oracle("tensor_parallel", tp, 2, 1, "fp32", "adamw")
    assert reference is None and why.startswith("TP sums each row-wise layer's products across ranks")
    assert oracle("tensor_parallel", tp, 2, 1, "fp32", "sgd") == (1, FP32_TOLERANCE)
    assert oracle("tensor_parallel", tp, 4, 2, "fp64", "adamw") == (1, FP64_TOLERANCE)
    assert tp["model"] == "gpt"


def test_fp32_adamw_has_no_exact_oracle_for_a_split_into_three():
    reference, why = oracle("ddp", settings("ddp"), 3, 1, "fp32", "adamw")
    assert reference is None and why == "3 micro-batch sums: not exact in fp32 (fp64 column)"


@pytest.mark.parametrize(
    ("impl", "world", "args", "expected"),
    [
        ("ddp", 2, [], ("fp32", 2, FP32_TOLERANCE)),  # compare's default: AdamW, 2 ranks
        ("ddp", 3, ["--global-batch-size", "48"], ("fp64", 1, FP64_TOLERANCE)),  # 3 sums: fp64 only
        ("ddp", 2, ["--optimizer", "sgd"], ("fp32", 1, FP32_TOLERANCE)),
        ("pipeline", 2, ["--microbatches", "4"], ("fp32", 4, FP32_TOLERANCE)),  # an option of its own
        ("dataparallel", 1, ["--grad-accum", "2"], ("fp32", 2, FP32_TOLERANCE)),
    ],
)
def test_compare_checks_each_run_against_its_exact_oracle(impl, world, args, expected):
    """What `nox -s compare` shows as exact parity: the run's own options decide the oracle."""
    run_args = with_defaults(DEFAULT_WORKLOAD, ["--dataset", "synthetic", *args])
    distributed = IMPLS[impl]["launcher"] == "torchrun"
    cfg = validate(IMPLS[impl]["train"], run_args, world, distributed)
    assert exact_oracle(impl, settings(impl), cfg, world) == expected


def test_a_long_run_is_shortened_to_a_parity_case():
    args = [
        "--model",
        "gpt",
        "--epochs",
        "2",
        "--target-accuracy",
        "0.9",
        "--eval-every=100",
        "--tensorboard",
    ]
    args += ["--out", "o", "--save-final", "o/f.pt", "--precision", "bf16", "--grad-accum", "2"]
    steps = str(SHORT_STEPS)
    assert shortened(args, "fp64") == [
        *["--model", "gpt", "--grad-accum", "2"],
        *["--steps", steps, "--log-every", steps, "--eval-every", steps, "--precision", "fp64"],
    ]
    assert "--grad-accum" not in shortened(args, "fp32", drop={"--grad-accum"})  # single sets its own


def test_the_matrix_marks_a_failure():
    cells = [
        {"row": ("ddp", "", 2, 1), "column": ("fp32", "sgd"), "difference": 3e-8, "passed": True},
        {"row": ("ddp", "", 2, 1), "column": ("fp64", "sgd"), "difference": 2e-3, "passed": False},
        {"row": ("ddp", "", 3, 1), "column": ("fp32", "adamw"), "skip": "3 micro-batch sums"},
    ]
    table = render(cells, ["--steps", "10"], 60.0)
    assert "| ddp | – | 2 | 1 | 3.0e-08 ✓ |  |" in table and "2.0e-03 **FAIL**" in table
    assert "| ddp | – | 3 | 1 |  | n/a (3 micro-batch sums) |" in table
    assert "2 runs compared, 1 failed" in table


@pytest.mark.parametrize("masked", [True, False], ids=["with-masked-rows", "no-masked"])
def test_the_matrix_runs_every_row_again_on_masked_targets(masked, tmp_path, monkeypatch):
    """The plan of the matrix (its runs replaced by failures, so nothing trains): every impl's rows, then
    the same on gpt with --dataset masked, whose fp32 AdamW cells defer to fp64; --no-masked drops them."""
    import json

    from distref import parity

    monkeypatch.setattr(parity, "run", lambda command, log: 1)
    argv = ["--impls", "ddp", "--impls-dir", str(ROOT / "impls"), "--out", str(tmp_path)]
    assert parity.main([*argv, *([] if masked else ["--no-masked"])]) == 1  # (every run "failed")
    cells = json.loads((tmp_path / "parity.json").read_text())
    options = {cell["row"][1] for cell in cells}
    assert options == ({"", "--model gpt --dataset masked"} if masked else {""})
    for cell in cells:
        on_masked = cell["row"][1] == "--model gpt --dataset masked"
        assert ("masked" in cell["args"]) == on_masked
        if on_masked and cell["column"] == ["fp32", "adamw"]:
            assert cell["skip"].startswith("gpt AdamW amplifies fp32 rounding")


def test_a_variant_giving_a_run_contract_option_is_refused_in_one_line(tmp_path, capsys):
    """A parity variant is the impl's own options: single's reference runs without it. One that single
    takes too (--top-k, which shapes the model) would compare unlike runs (top-1 against top-2: 0.73
    apart), so the matrix refuses it before running anything, and every impl's table is clean."""
    import shutil

    from distref.parity import main, options_single_takes, parity_settings

    for pyproject in sorted((ROOT / "impls").glob("*/pyproject.toml")):
        assert options_single_takes(parity_settings(pyproject.parent)["variants"]) == [], pyproject
    impls = tmp_path / "impls"
    for impl in ("single", "expert_parallel"):
        shutil.copytree(ROOT / "impls" / impl, impls / impl, ignore=shutil.ignore_patterns("tests"))
    table = impls / "expert_parallel" / "pyproject.toml"
    table.write_text(
        table.read_text().replace('variants = [[], ["--ep", "2"]]', 'variants = [["--top-k", "1"]]')
    )
    with pytest.raises(SystemExit) as exit_info:
        main(["--impls", "expert_parallel", "--impls-dir", str(impls), "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert "expert_parallel's parity variants give --top-k, a run-contract option" in capsys.readouterr().err
