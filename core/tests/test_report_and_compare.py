"""The comparison runner and report: built from small real runs, refusing to mix workloads."""

import contextlib
import html.parser
import json
import re
import shutil
import struct
import sys
import zlib
from pathlib import Path

import pytest
import torch
from filelock import FileLock

from distref import impl_version
from distref.config import RunConfig
from distref.record import RunRecord, load_record
from distref.report import build_report
from distref.testing import ROOT, forked_subprocess, run_script

WORKLOAD = [
    "--model",
    "lenet",
    "--dataset",
    "synthetic",
    "--steps",
    "12",
    "--eval-every",
    "6",
    "--optimizer",
    "sgd",
    "--lr",
    "0.01",
    "--global-batch-size",
    "32",
    "--target-accuracy",
    "0.1",
]
PLOTS = ["loss_vs_step.png", "loss_vs_time.png", "accuracy_vs_time.png", "throughput.png", "peak_memory.png"]


def assert_valid_png(path: Path) -> None:
    """PNG signature, then every chunk's CRC, up to IEND; and a non-trivial image size."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    pos, chunks = 8, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert zlib.crc32(kind + body) == crc, f"{path}: bad {kind} chunk"
        chunks.append(kind)
        pos += 12 + length
    assert chunks[0] == b"IHDR" and chunks[-1] == b"IEND" and b"IDAT" in chunks
    width, height = struct.unpack(">II", data[16:24])
    assert width > 300 and height > 200


@pytest.fixture(scope="session")
def compared(tmp_path_factory, worker_id):
    """`python -m distref.compare --impls ddp` (2 ranks): runs single too, a few steps each. Once per test
    session, not once per xdist worker (the tests using it land on both): the folder above the workers'
    temporary folders is the session's, and the lock makes the second worker wait for the first's run.
    In this process, its runs forked (distref.testing.forked_subprocess: ranks that do not import torch
    again); compare's command line and its real processes: test_a_run_that_dies_before_its_record_...."""
    from distref import compare, parity

    shared = tmp_path_factory.getbasetemp()
    shared = shared.parent if worker_id != "master" else shared
    out, stdout = shared / "compare", shared / "compare.stdout"
    with FileLock(shared / "compare.lock"):
        if not stdout.exists():
            argv = ["--impls", "ddp", "--world-size", "2", "--impls-dir", str(ROOT / "impls")]  # (+ single)
            with (
                pytest.MonkeyPatch.context() as patch,
                open(shared / "compare.partial", "w") as printed,
                contextlib.redirect_stdout(printed),
            ):
                stand_ins = [forked_subprocess(), forked_subprocess()]
                for tool, stand_in in zip((compare, parity), stand_ins, strict=True):
                    patch.setattr(tool, "subprocess", stand_in)
                try:
                    compare.main([*argv, *WORKLOAD, "--out", str(out)])
                except SystemExit as exit_:  # (what compare said, in the failure)
                    printed.flush()
                    text = (shared / "compare.partial").read_text()[-3000:]
                    pytest.fail(f"compare exited {exit_.code}:\n{text}")
            # single's and ddp's runs, then each against its exact oracle: forked
            assert [len(stand_in.forked) for stand_in in stand_ins] == [2, 2], stand_ins
            (shared / "compare.partial").rename(stdout)
    return out, stdout.read_text()


def test_compare_runs_each_impl_and_builds_the_report(compared):
    out, stdout = compared
    assert "[1/2] single" in stdout and "[2/2] ddp" in stdout  # progress, per impl and overall
    assert stdout.strip().splitlines()[-1].endswith(f"report: {out / 'report.md'}")  # the path, at the end
    report = (out / "report.md").read_text()
    for plot in PLOTS:
        assert f"]({plot})" in report
        assert_valid_png(out / plot)
    assert "pipeline_bubble.png" not in report  # no pipeline impl ran
    parity = report.split("## Parity with single")[1].split("##")[0]
    assert "| single ×1 | reference |" in parity
    # Exact parity from compare's own short runs against the oracle (SGD: plain single), and the drift of
    # the full runs' final.pt apart, as its own column.
    exact, oracle, tolerance, drift = next(
        line for line in parity.splitlines() if line.startswith("| ddp ×2")
    ).split("|")[2:6]
    assert float(exact.split()[0]) < 1e-5 and exact.split()[1] == "✓"
    assert oracle.strip() == "single, fp32, 20 steps" and tolerance.strip() == "1e-05"
    assert 0 <= float(drift) < 1e-5  # 12 steps of SGD: no room to drift
    check = json.loads((out / "ddp" / "parity.json").read_text())
    assert check["difference"] == pytest.approx(float(exact.split()[0]), rel=0.06)
    assert "ddp ×2 vs single (fp32): " in stdout
    versions = report.split("## Versions and environment")[1]
    ddp_version = impl_version(ROOT / "impls" / "ddp" / "train.py")
    assert f"| ddp ×2 | {ddp_version} |" in versions and "gloo" in versions
    assert_rendered_html(out / "report.html", report)


def test_the_plan_equals_what_the_compare_runs_measured(compared, capsys):
    """`python -m distref.plan --validate`, the closed loop, on compare's runs (single, and ddp at 2 ranks):
    the plan for the same model, layout and batch gives their rank 0's model states, activations and one
    step's communication exactly (fp32: the impls' own formulas, proven against measurement), and the
    utilisation of the CPU's peak their step time implies."""
    from distref import plan

    out, _ = compared
    assert plan.main(["--validate", str(out / "single"), str(out / "ddp"), "--json"]) == 0
    results = {r["impl"]: r for r in json.loads(capsys.readouterr().out)}
    assert results["single"]["layout"] == "ddp dp1" and results["ddp"]["layout"] == "ddp dp2"
    for result in results.values():
        for quantity in ("model_states", "activations"):
            measured, planned = result[quantity]
            assert measured > 0 and planned == measured, (result["impl"], quantity)
        assert result["step_s"][0] > 0 and 0 < result["implied_mfu"] < 1
    assert results["single"]["communication_bus_bytes"] == [0, 0]
    measured, planned = results["ddp"]["communication_bus_bytes"]
    assert measured > 0 and planned == pytest.approx(measured, rel=1e-12)
    text = plan.render_validation(list(results.values()))
    assert text.count("(1.000×, exact)") >= 5 and "implied MFU" in text
    _, stdout = compared  # compare prints it after every comparison, and keeps it beside the report
    assert (
        "plan: measured vs planned" in stdout
        and f"{out / 'ddp'} (ddp, ddp dp2, rank 0): model states " in stdout
    )
    assert json.loads((out / "plan_validation.json").read_text()) == list(results.values())
    # A run with an option the plan takes at its default is still compared, and says which
    record = json.loads((out / "ddp" / "record.json").read_text())
    record["config"]["extra"]["comm_hook"] = "bf16"
    assert plan.validate_run(record)["not_planned"] == ["comm_hook=bf16"]
    assert results["ddp"]["not_planned"] == []


def test_validate_refuses_a_record_it_cannot_read_in_one_line(compared, tmp_path, capsys):
    """A truncated record, one whose per-rank lists disagree with its world size: one line, exit 2; a run
    that did not complete is skipped, saying so."""
    from distref import plan

    out, _ = compared
    record = json.loads((out / "ddp" / "record.json").read_text())
    cases = {
        "truncated": (out / "ddp" / "record.json").read_text()[:300],
        "world": json.dumps(record | {"world_size": 4}),
        "failed": json.dumps(record | {"status": "failed"}),
    }
    for name, text in cases.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "record.json").write_text(text)
    assert plan.main(["--validate", str(tmp_path / "truncated")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a run record this plan can read (JSONDecodeError" in err
    assert plan.main(["--validate", str(tmp_path / "world")]) == 2
    assert "its model_state_bytes holds 2 ranks, its world_size says 4" in capsys.readouterr().err
    assert plan.main(["--validate", str(tmp_path / "failed")]) == 0
    assert "skipped: the run did not complete (status 'failed')" in capsys.readouterr().out


class _PageText(html.parser.HTMLParser):
    """What a browser shows of a page (text outside tags, but no <style>) and the tags it has."""

    def __init__(self):
        super().__init__()
        self.text, self.tags, self._in_style = [], [], False

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self._in_style = tag == "style"

    def handle_endtag(self, tag):
        self._in_style = False

    def handle_data(self, data):
        if not self._in_style:
            self.text.append(data)


def assert_rendered_html(page: Path, markdown: str) -> None:
    """report.html is report.md rendered: its headings, tables, emphasis and code are HTML, and no
    Markdown marker is left in the text a browser shows."""
    shown = _PageText()
    shown.feed(page.read_text())
    text = "".join(shown.text)
    for marker in ("|---", "**", "`", "](", "\n## ", "\n# "):
        assert marker not in text, f"Markdown {marker!r} left in report.html"
    assert "*exact parity*" in markdown and "exact parity" in text  # emphasised in the .md, shown as text
    assert {"h1", "h2", "table", "th", "td", "img", "em", "code"} <= set(shown.tags)
    separators = [line for line in markdown.splitlines() if re.fullmatch(r"\|( *:?-+:? *\|)+", line)]
    assert shown.tags.count("table") == len(separators) >= 3  # every Markdown table became a table


def test_report_is_a_command_of_its_own(compared, tmp_path):
    out, _ = compared
    result = run_script(
        [
            sys.executable,
            "-m",
            "distref.report",
            str(out / "single"),
            str(out / "ddp"),
            "--out",
            str(tmp_path / "again"),
        ]
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"report: {tmp_path / 'again' / 'report.md'}"
    assert (tmp_path / "again" / "throughput.png").exists()


def test_report_takes_the_compare_folder_or_everything_in_it(compared, tmp_path):
    """`distref.report runs/compare/<t>` and `runs/compare/<t>/*` (plots and report.md included) both
    mean the runs in it."""
    out, _ = compared
    everything = sorted(str(p) for p in out.iterdir())
    assert any(p.endswith(".png") for p in everything) and any(p.endswith("report.md") for p in everything)
    for args, name in (([str(out)], "folder"), (everything, "glob")):
        report = build_report(args, tmp_path / name).read_text()
        parity = report.split("## Parity with single")[1].split("##")[0]
        assert "| single ×1 | reference |" in parity and "| ddp ×2 |" in parity
    with pytest.raises(SystemExit, match=r"holds no record\.json"):
        build_report([str(tmp_path / "nothing-here")], tmp_path / "none")


def test_report_states_evaluation_apart_and_a_single_device_as_such(compared, tmp_path):
    out, _ = compared
    dp = tmp_path / "dataparallel"  # DataParallel on CPU: one process, one device
    dp_record = load_record(out / "single")
    dp_record.update(impl={"name": "dataparallel", "version": "x"}, devices=1)
    dp.mkdir()
    (dp / "record.json").write_text(json.dumps(dp_record))
    report = build_report([out / "single", out / "ddp", dp], tmp_path / "report").read_text()
    speed = report.split("## Throughput and scaling")[1].split("##")[0]
    # single's own numbers as dataparallel's: equal hardware and speed, so speed-up = efficiency = 1.
    assert "| dataparallel ×1 (no parallelism) | 1 process × 1 thread |" in speed
    dp_row = next(line for line in speed.splitlines() if line.startswith("| dataparallel"))
    assert [c.strip() for c in dp_row.split("|")[4:6]] == ["1.00", "1.00"]
    ddp, single = load_record(out / "ddp"), load_record(out / "single")
    assert ddp["eval_time_s"] == pytest.approx(sum(e["eval_time_s"] for e in ddp["evals"]))
    assert ddp["train_time_s"] == pytest.approx(sum(s["step_time_s"] for s in ddp["steps"]))
    ddp_row = next(line for line in speed.splitlines() if line.startswith("| ddp ×2"))
    assert ddp_row.split("|")[2].strip() == "2 processes × 1 thread"  # compare runs 1 thread each
    speed_up = ddp["samples_per_s"] / single["samples_per_s"]
    assert ddp_row.split("|")[4].strip() == f"{speed_up:.2f}"
    assert ddp_row.split("|")[5].strip() == f"{speed_up / 2:.2f}"  # 2 cores against single's 1
    assert ddp_row.split("|")[6].strip() == f"{ddp['startup_time_s']:.1f}"
    assert ddp_row.split("|")[7].strip() == f"{ddp['train_time_s']:.1f}"
    evaluation = ddp["eval_time_s"]  # two significant figures at least: the note compares them
    assert ddp_row.split("|")[8].strip() == (f"{evaluation:.1f}" if evaluation >= 1 else f"{evaluation:#.2g}")
    assert ddp_row.split("|")[9].strip() == f"{ddp['wall_time_s']:.1f}"
    # Wall time runs from each rank's process start: its start-up (imports, data, process group) too.
    assert ddp["wall_time_s"] >= ddp["startup_time_s"] + ddp["train_time_s"] + ddp["eval_time_s"]
    state = report.split("## Model state per rank")[1].split("##")[0]
    # lenet's 21,840 fp32 parameters, their gradients and SGD's momentum: 4 + 4 + 4 bytes each, per rank
    # ... next to what a fully sharded layout (ZeRO-3, FSDP) would hold: single's 255.9 KiB over 2 ranks
    assert "| ddp ×2 | 0 | 85.3 | 85.3 | 85.3 | 255.9 | 128.0 |" in state
    assert "| ddp ×2 | 1 | 85.3 | 85.3 | 85.3 | 255.9 | 128.0 |" in state
    target = report.split("## Time to target accuracy")[1].split("##")[0]
    assert "counted as MLPerf counts it: from the end of initialisation (the first step)" in target
    first = next(e for e in ddp["evals"] if e["accuracy"] >= ddp["target_accuracy"])
    ddp_target = next(line for line in target.splitlines() if line.startswith("| ddp ×2"))
    assert ddp_target.split("|")[5].strip() == str(first["step"])
    assert ddp_target.split("|")[7].strip() == f"{ddp['startup_time_s']:.1f}"  # shown beside it


def test_different_workloads_are_not_compared_side_by_side(compared, tmp_path):
    out, _ = compared
    other = tmp_path / "other"
    shutil.copytree(out / "ddp", other)
    record = json.loads((other / "record.json").read_text())
    record["config"]["global_batch_size"] = 64
    (other / "record.json").write_text(json.dumps(record))
    with pytest.raises(
        SystemExit, match=r"different workloads.*--global-batch-size: single ×1=32, ddp ×2=64"
    ):
        build_report([out / "single", other], tmp_path / "refused")
    assert not (tmp_path / "refused" / "report.md").exists()
    threads = tmp_path / "threads"  # the same workload, but 2 threads per rank
    shutil.copytree(out / "ddp", threads)
    record = json.loads((threads / "record.json").read_text())
    record["environment"]["threads_per_rank"] = 2
    (threads / "record.json").write_text(json.dumps(record))
    with pytest.raises(SystemExit, match=r"threads per rank: single ×1=1, ddp ×2=2"):
        build_report([out / "single", threads], tmp_path / "refused-threads")
    report = build_report([out / "single", other], tmp_path / "mixed", allow_mixed=True).read_text()
    assert "These runs are different workloads" in report
    assert report.splitlines()[0] == "# distref comparison: mixed workloads"  # not the first run's settings
    assert "> - ddp ×2: lenet on synthetic, 12 steps, global batch 64" in report


@pytest.mark.parametrize(
    ("key", "value", "shown"),
    [
        ("gpt_layers", 6, "--gpt-layers: single ×1=2, ddp ×2=6"),
        ("lr_schedule", "constant", "--lr-schedule: single ×1=cosine, ddp ×2=constant"),
        ("weight_decay", 0.1, "--weight-decay: single ×1=0.0, ddp ×2=0.1"),
    ],
)
def test_every_option_that_defines_a_run_defines_the_workload(compared, tmp_path, key, value, shown):
    """The report's workload is what the resume check calls one run (one list, RUN_DEFINING_OPTIONS),
    plus its length: e.g. gpt of 2 and of 6 layers are not one workload."""
    from distref.report import WORKLOAD_KEYS
    from distref.training import MUST_MATCH

    assert set(MUST_MATCH) <= set(WORKLOAD_KEYS)
    out, _ = compared
    other = tmp_path / "other"
    shutil.copytree(out / "ddp", other)
    record = json.loads((other / "record.json").read_text())
    record["config"][key] = value
    (other / "record.json").write_text(json.dumps(record))
    with pytest.raises(SystemExit, match=f"different workloads.*{re.escape(shown)}"):
        build_report([out / "single", other], tmp_path / "refused")


def test_two_runs_of_one_impl_on_different_workloads_are_refused(compared, tmp_path):
    """Two runs of single share a label: each still counts (they once collapsed into one, and any two
    single runs were reported side by side)."""
    out, _ = compared
    for name, layers in (("a", 2), ("b", 3)):
        shutil.copytree(out / "single", tmp_path / name)
        record = json.loads((tmp_path / name / "record.json").read_text())
        record["config"]["gpt_layers"] = layers
        (tmp_path / name / "record.json").write_text(json.dumps(record))
    with pytest.raises(SystemExit, match=re.escape("--gpt-layers: single ×1=2, single ×1=3")):
        build_report([tmp_path / "a", tmp_path / "b"], tmp_path / "refused")


def test_a_text_file_is_part_of_the_workload_and_a_dataset_folder_is_not(compared, tmp_path):
    out, _ = compared
    for dataset, root, refused in [("mnist", "/elsewhere", False), ("text", "/other.txt", True)]:
        runs = []
        for name, data_root in [("single", "/data"), ("ddp", root)]:
            shutil.copytree(out / name, tmp_path / dataset / name)
            record = json.loads((tmp_path / dataset / name / "record.json").read_text())
            record["config"].update(dataset=dataset, data_root=data_root)
            (tmp_path / dataset / name / "record.json").write_text(json.dumps(record))
            runs.append(tmp_path / dataset / name)
        if refused:
            with pytest.raises(
                SystemExit, match=re.escape("--data-root: single ×1=/data, ddp ×2=/other.txt")
            ):
                build_report(runs, tmp_path / f"report-{dataset}")
        else:
            assert build_report(runs, tmp_path / f"report-{dataset}").exists()


def test_a_failed_strategy_appears_with_its_error(compared, tmp_path):
    out, _ = compared
    failed = tmp_path / "failed"
    without_extra = {k: v for k, v in load_record(out / "ddp")["config"].items() if k != "extra"}
    record = RunRecord(
        "ddp", "0.1.0", RunConfig(**{**without_extra, "out": str(failed)}), 2, torch.device("cpu"), "gloo"
    )
    # An error as exceptions write them: several lines, a `|`, Markdown's own characters.
    record.fail("RuntimeError: Connection closed by peer | rank 1\n*second* line `x` [y]_z")
    report = build_report([out / "single", failed], tmp_path / "report").read_text()
    assert "## Failed runs" in report and "Connection closed by peer" in report
    assert "| ddp ×2 | failed |" in report
    page = _PageText()
    page.feed((tmp_path / "report" / "report.html").read_text())
    text = "".join(page.text)
    # One row, the error whole in its cell: the `|` did not split it, the newline did not end the row.
    assert "RuntimeError: Connection closed by peer | rank 1 *second* line `x` [y]_z" in text


def test_a_run_that_dies_before_its_record_is_reported_and_compare_fails(tmp_path):
    impls = tmp_path / "impls"
    shutil.copytree(ROOT / "impls" / "single", impls / "single", ignore=shutil.ignore_patterns("tests"))
    (impls / "crashy").mkdir()
    (impls / "crashy" / "pyproject.toml").write_text(
        '[project]\nname = "crashy"\nversion = "0.0.1"\n[tool.distref]\ntools_call = ["parse_options"]\n'
    )
    (impls / "crashy" / "train.py").write_text(
        "import os, sys\nfrom distref.cli import parse_config\n"
        "def parse_options(argv, world_size=1):\n    return parse_config(argv, 'crashy', world_size=world_size)\n"
        "if __name__ == '__main__':\n    parse_options(sys.argv[1:])\n"
        "    print('RuntimeError: simulated crash at start-up', flush=True)\n    os._exit(3)\n"
    )
    result = run_script(
        [
            sys.executable,
            "-m",
            "distref.compare",
            "--impls-dir",
            str(impls),
            *WORKLOAD,
            "--out",
            str(tmp_path / "out"),
        ],
        timeout=300,
        env={"OMP_NUM_THREADS": "3"},  # compare's own (its runs get 1): an H200 host's compare had 16
    )
    # A comparison with a failed run is no result: exit code 1, one line per failed run, the report kept.
    assert result.returncode == 1, result.stderr[-2000:]
    assert result.stderr.splitlines()[-2:] == [
        "distref.compare: error: 1 of 2 runs failed (report lists them):",
        "  crashy: ended before writing its record: exit code 3: RuntimeError: simulated crash at start-up",
    ]
    report = (tmp_path / "out" / "report.md").read_text()
    assert "ended before writing its record: exit code 3: RuntimeError: simulated crash at start-up" in report
    # compare's record of it: the device its options ask for, the one thread compare gave it, not its own
    environment = load_record(tmp_path / "out" / "crashy")["environment"]
    assert (environment["device"], environment["device_name"], environment["threads_per_rank"]) == (
        "cpu",
        "not recorded",
        1,
    )
    assert report.index("## Failed runs") < report.index("## Parity")  # at the top


def test_bad_options_fail_before_any_run_starts(tmp_path):
    result = run_script(
        [
            sys.executable,
            "-m",
            "distref.compare",
            "--impls-dir",
            str(ROOT / "impls"),
            "--dataset",
            "synthetic",
            "--global-batch-size",
            "7",
            "--out",
            str(tmp_path / "x"),
        ]
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [  # ddp (2 ranks) cannot split 7 samples
        "ddp/train.py: error: --global-batch-size 7 must be divisible by world size × --grad-accum = 2 × 1 = 2"
    ]
    assert not (tmp_path / "x").exists()  # nothing was started


def test_unknown_impl_is_one_line():
    result = run_script(
        [sys.executable, "-m", "distref.compare", "--impls-dir", str(ROOT / "impls"), "--impls", "ddp,fsdp9"]
    )
    assert result.returncode == 2
    available = ", ".join(sorted(p.parent.name for p in (ROOT / "impls").glob("*/train.py")))
    assert result.stderr.strip().splitlines() == [
        f"python -m distref.compare: error: unknown impl(s) fsdp9; available: {available}"
    ]


def test_compare_help_shows_the_default_workload_and_the_pass_through():
    result = run_script([sys.executable, "-m", "distref.compare", "--help"])
    assert result.returncode == 0
    text = " ".join(result.stdout.split())  # argparse wraps lines
    assert "Any other option is a run option passed to every impl's train.py" in text
    assert "--model lenet --dataset mnist --epochs 1" in text
    assert "--target-accuracy is the model and dataset's own (lenet on mnist: 0.955, " in text


def test_compare_can_validate_every_impl():
    """compare loads every impls/*/train.py to check its arguments before running anything: each must
    load that way (a train.py defining a dataclass once did not) and accept the default workload."""
    from distref.compare import DEFAULT_WORKLOAD, with_target
    from distref.config import with_defaults
    from distref.impl_folders import discover, validate
    from distref.report import TARGETS

    found = discover(ROOT / "impls")
    assert {"single", "ddp", "dataparallel", "model_parallel", "tensor_parallel"} <= set(found)
    for info in found.values():
        distributed = info["launcher"] == "torchrun"
        model = ["--model", "gpt", "--dataset", "synthetic"] if info["models"] else []
        model += ["--experts", "4"] if info["experts"] == "required" else []  # (expert_parallel)
        run_args, _ = with_target(with_defaults(DEFAULT_WORKLOAD, model))
        cfg = validate(info["train"], run_args, 2 if distributed else 1, distributed)
        assert cfg.model == ("gpt" if info["models"] else "lenet")
        assert cfg.target_accuracy == TARGETS[(cfg.model, cfg.dataset)]


def test_an_impl_made_for_another_model_is_left_out_and_says_why():
    """tensor_parallel trains gpt only: a lenet comparison leaves it out (the report lists it with the
    reason) instead of failing on its refusal; a gpt comparison runs it."""
    from distref.compare import made_for_the_model
    from distref.impl_folders import discover

    found = discover(ROOT / "impls")
    chosen, not_run = made_for_the_model(found, ["single", "ddp", "tensor_parallel"], ["--steps", "5"])
    assert chosen == ["single", "ddp"]
    assert not_run == [("tensor_parallel", "trains --model gpt only; this workload is --model lenet")]
    chosen, not_run = made_for_the_model(found, ["single", "tensor_parallel"], ["--model", "gpt"])
    assert chosen == ["single", "tensor_parallel"] and not_run == []


# ---- the cost table and the pipeline section, from records made here (no run needed) -----------------
def made_record(folder: Path, impl: str, ranks: int, options: dict | None = None, **fields) -> Path:
    """A completed record of `impl` on `ranks` ranks (3 synthetic steps, one workload for all, `options`
    changing it), with `fields` set as its own: what an impl writes, without running one."""
    workload = {"dataset": "synthetic", "steps": 3, "global_batch_size": 24, "optimizer": "sgd"}
    cfg = RunConfig(**{**workload, **(options or {})}, out=str(folder))
    record = RunRecord(impl, "0.0.0", cfg, ranks, torch.device("cpu"), "gloo")
    record.add_steps(0, [2.3, 2.2, 2.1], [0.2, 0.1, 0.1])
    record.data.update(status="completed", samples_per_s=240.0, peak_memory_bytes=[500 * 2**20] * ranks)
    record.data.update(fields)
    record.write()
    return folder


def counts(**kinds: tuple[int, int]) -> dict:
    """{kind: {"calls", "bytes", "bus_bytes"}} from kind=(calls, bytes) (bus bytes: the bytes)."""
    return {k: {"calls": c, "bytes": b, "bus_bytes": float(b)} for k, (c, b) in kinds.items()}


STATES = {"parameters": 87360, "gradients": 87360, "optimizer": 174752}  # lenet with AdamW: 341.3 KiB


def communication(measured: list[dict], predicted: list[dict] | None) -> dict:
    return {"step": 2, "measured": measured, "predicted": predicted, "phases": {}, "counting_overhead_s": 0.0}


def row_of(section: str, label: str) -> list[str]:
    line = next(line for line in section.splitlines() if line.startswith(f"| {label} |"))
    return [cell.strip() for cell in line.split("|")[1:-1]]


def test_cost_table_says_exact_or_the_difference_and_older_records_still_render(tmp_path):
    ddp = [counts(all_reduce=(1, 87360))] * 2
    fsdp = [counts(all_gather=(7, 172680), reduce_scatter=(4, 87360))] * 2
    # The formula 4 bytes short on rank 0's reduce-scatters, one call and 1 KiB on rank 1's all_gathers,
    # and 12 bytes on rank 0's gradients
    fsdp_formula = [
        counts(all_gather=(7, 172680), reduce_scatter=(4, 87360 - 4)),
        counts(all_gather=(6, 172680 - 1024), reduce_scatter=(4, 87360)),
    ]
    half = {k: v // 2 for k, v in STATES.items()}
    runs = [
        made_record(
            tmp_path / "single",
            "single",
            1,
            communication=communication([{}], [{}]),
            model_state_bytes=[STATES],
            model_state_bytes_predicted=[STATES],
            activation_bytes={"measured": [1263940], "predicted": [1263940]},
        ),
        made_record(
            tmp_path / "ddp",
            "ddp",
            2,
            communication={**communication(ddp, ddp), "counting_overhead_s": 0.05},
            train_time_s=2.0,  # counting the step cost 0.05 s of it
            model_state_bytes=[STATES] * 2,
            model_state_bytes_predicted=[STATES] * 2,
            activation_bytes={"measured": [631972] * 2, "predicted": [631972] * 2},
        ),
        made_record(
            tmp_path / "fsdp",
            "fsdp",
            2,
            communication=communication(fsdp, fsdp_formula),
            model_state_bytes=[half] * 2,
            model_state_bytes_predicted=[{**half, "gradients": half["gradients"] - 12}, half],
            activation_bytes={"measured": [631972] * 2, "predicted": None},
        ),
        # model_parallel: the first stage sends more than the last (ranks differ)
        made_record(
            tmp_path / "model_parallel",
            "model_parallel",
            2,
            communication=communication(
                [counts(send=(2, 30784), recv=(1, 30720)), counts(recv=(2, 30784), send=(1, 30720))], None
            ),
        ),
    ]
    older = made_record(tmp_path / "older", "deepspeed_zero", 2, model_state_bytes=[STATES] * 2)
    record = json.loads((older / "record.json").read_text())
    for key in ("communication", "model_state_bytes_predicted", "activation_bytes"):  # before the cost model
        del record[key]
    (older / "record.json").write_text(json.dumps(record))

    out = tmp_path / "report"
    report = build_report([*runs, older], out).read_text()
    cost = report.split("## Cost: ")[1].split("\n## ")[0]
    assert row_of(cost, "single ×1") == [
        *(
            "single ×1",
            "1",
            "none",
            "0 B",
            "exact",
            "341.3 KiB",
            "exact",
            "1.2 MiB",
            "exact",
            "500.0 MiB",
            "—",  # (no training time in this record)
        )
    ]
    assert row_of(cost, "ddp ×2") == [
        *("ddp ×2", "2", "all_reduce: 1 call, 85.3 KiB (every rank)", "85.3 KiB", "exact"),
        *("341.3 KiB", "exact", "617.2 KiB", "exact", "500.0 MiB", "2.5% of training (+0.050 s)"),
    ]
    assert row_of(cost, "fsdp ×2") == [
        *("fsdp ×2", "2", "reduce_scatter: 4 calls, 85.3 KiB; all_gather: 7 calls, 168.6 KiB (every rank)"),
        "253.9 KiB",
        "**differs** (measured − formula): rank 0 reduce_scatter +0 calls, +4 B; "
        "rank 1 all_gather +1 calls, +1.0 KiB",
        "170.6 KiB",
        "**differs** (measured − formula): rank 0 gradients +12 B",
        *("617.2 KiB", "no formula", "500.0 MiB", "—"),
    ]
    assert row_of(cost, "model_parallel ×2")[2:5] == [
        "send: 2 calls, 30.1 KiB; recv: 1 call, 30.0 KiB (rank 0; ranks differ)",
        "60.1 KiB",
        "no formula",
    ]
    assert row_of(cost, "deepspeed_zero ×2")[2:] == [
        *("—", "—", "—", "341.3 KiB", "—", "—", "—", "500.0 MiB", "—")
    ]
    assert "*exact* means the same calls and bytes of every kind on every rank" in cost  # COST_NOTE
    assert "](communication_per_step.png)" in cost
    assert_valid_png(out / "communication_per_step.png")
    assert "## Pipeline" not in report  # no pipeline among them
    assert_rendered_html(out / "report.html", report)

    # Older records alone: the table of dashes, and no plot of communication (none recorded).
    alone = build_report([older], tmp_path / "older-only").read_text()
    assert row_of(alone.split("## Cost: ")[1], "deepspeed_zero ×2")[2] == "—"
    assert "communication_per_step.png" not in alone
    assert not (tmp_path / "older-only" / "communication_per_step.png").exists()


def timeline(started_at: float, schedule_s: float, work: list) -> dict:
    return {"step": 1, "counted": False, "started_at": started_at, "schedule_s": schedule_s, "work": work}


def test_pipeline_section_puts_the_formula_beside_the_measured_bubble_and_draws_each_timeline(tmp_path):
    def pipeline(name: str, schedule: str, stages: int, m: int, bubble: float, timelines=None) -> Path:
        facts = {"schedule": schedule, "microbatches": m, "dp": 1, "stages": stages}
        facts["busy_fraction"] = [1 - bubble, 1 - bubble]
        return made_record(
            tmp_path / name,
            "pipeline",
            2,
            bubble_fraction=bubble,
            strategy={**facts, **({"timeline": timelines} if timelines else {})},
        )

    # 1F1B on 2 ranks, M = 2: rank 0 busy 4 of its 10 ms, rank 1 (started 1 ms later) 2 of 10 ms
    one_f_one_b = [
        timeline(
            100.0, 0.010, [["F", 0, 0, 0.0, 0.001], ["F", 0, 1, 0.001, 0.002], ["B", 0, 0, 0.006, 0.007]]
        ),
        timeline(100.001, 0.010, [["F", 1, 0, 0.001, 0.002], ["B", 1, 0, 0.002, 0.003]]),
    ]
    one_f_one_b[0]["work"].append(["B", 0, 1, 0.009, 0.010])
    # Interleaved zero bubble: stages 0 and 2 on rank 0, input (I) and weight (W) gradients apart
    zero_bubble = [
        timeline(
            5.0, 0.005, [["F", 0, 0, 0.0, 0.001], ["F", 2, 0, 0.002, 0.003], ["I", 2, 0, 0.003, 0.0035]]
        ),
        timeline(
            5.0, 0.005, [["F", 1, 0, 0.001, 0.002], ["F", 3, 0, 0.0025, 0.003], ["W", 3, 0, 0.003, 0.004]]
        ),
    ]
    runs = [
        made_record(tmp_path / "single", "single", 1),
        pipeline("1f1b", "1f1b", 2, 4, 0.5, one_f_one_b),
        pipeline("interleaved", "interleaved-1f1b", 4, 4, 0.4),
        pipeline("zero-bubble", "interleaved-zero-bubble", 4, 4, 0.3, zero_bubble),
    ]
    out = tmp_path / "report"
    report = build_report(runs, out, allow_mixed=False).read_text()
    section = report.split("## Pipeline: ")[1].split("\n## ")[0]
    rows = [line for line in section.splitlines() if line.startswith("| pipeline ×2 |")]
    cells = [[c.strip() for c in line.split("|")[2:-1]] for line in rows]
    # (p-1)/(m+p-1) = 1/5; interleaved (p-1)/(v·m+p-1) = 1/9; zero bubble: none. The timeline's step:
    # idle 6/10 and 8/10, mean 0.7; 2.5/5 each
    assert cells == [
        ["1f1b", "2 × 1", "4", "0.20", "0.50", "0.50, 0.50", "step 1: 0.70"],
        ["interleaved-1f1b", "2 × 2", "4", "0.11", "0.40", "0.60, 0.60", "—"],
        ["interleaved-zero-bubble", "2 × 2", "4", "no formula", "0.30", "0.70, 0.70", "step 1: 0.50"],
    ]
    assert "(p-1)/(m+p-1) for GPipe and 1F1B" in section  # PIPELINE_NOTE
    for plot in ("pipeline_bubble.png", "pipeline_timeline_1.png", "pipeline_timeline_2.png"):
        assert f"]({plot})" in section
        assert_valid_png(out / plot)
    assert "pipeline_timeline_3.png" not in report  # the interleaved record has no timeline
    assert section.index("pipeline_timeline_1.png") < section.index("pipeline_timeline_2.png")
    assert "Pipeline timeline: pipeline ×2 (1f1b)" in section


def evaluated_once(seconds: float, accuracy: float = 0.5) -> dict:
    """A record's fields for one evaluation, after the last step, that took `seconds`."""
    evaluation = {"step": 3, "epoch": 0.01, "elapsed_s": 1.0, "eval_time_s": seconds, "accuracy": accuracy}
    return {"evals": [{**evaluation, "loss": 1.0}], "eval_time_s": seconds, "final_accuracy": accuracy}


def test_the_evaluation_claim_follows_from_the_figures_the_table_shows(tmp_path):
    """Evaluation times as the table shows them (two significant figures: 0.12 and 0.090, not 0.1 and
    0.1) and a sentence computed from those figures, not a claimed world-size speed-up."""
    runs = [
        made_record(tmp_path / "single", "single", 1, **evaluated_once(0.12)),
        made_record(tmp_path / "ddp", "ddp", 2, **evaluated_once(0.09)),
        made_record(tmp_path / "fsdp", "fsdp", 2, **evaluated_once(0.1249)),  # shown 0.12, as single
        made_record(tmp_path / "pipeline", "pipeline", 2, **evaluated_once(0.3)),
    ]
    report = build_report(runs, tmp_path / "report").read_text()
    speed = report.split("## Throughput and scaling")[1].split("\n## ")[0]
    shown = {label: row_of(speed, label)[7] for label in ("single ×1", "ddp ×2", "fsdp ×2", "pipeline ×2")}
    assert shown == {"single ×1": "0.12", "ddp ×2": "0.090", "fsdp ×2": "0.12", "pipeline ×2": "0.30"}
    target = report.split("## Time to target accuracy")[1].split("\n## ")[0]
    assert "world-size times faster" not in report
    assert (
        "Here, from the evaluation column above: ddp ×2 1.3× faster than single (0.090 s against 0.12 s); "
        "fsdp ×2 about as fast as single (0.12 s against 0.12 s); "
        "pipeline ×2 2.5× slower than single (0.30 s against 0.12 s)." in target
    )


def test_a_target_belongs_to_its_dataset(tmp_path):
    """A run without a target says *none*; MNIST's target (0.955) on synthetic images says whose target it
    is, not *not reached*; a target of the run's own that it missed is *not reached*."""
    from distref.report import TARGETS

    def target_row(name: str, target: float | None) -> list[str]:
        run = made_record(tmp_path / name, "single", 1, {"target_accuracy": target}, **evaluated_once(0.1))
        record = json.loads((run / "record.json").read_text())
        assert record["target_accuracy"] == target and record["time_to_target_s"] is None
        report = build_report([run], tmp_path / f"report-{name}").read_text()
        return row_of(report.split("## Time to target accuracy")[1], "single ×1")[1:4]

    assert target_row("none", None) == ["none", "0.5000", "— (no target)"]
    assert target_row("mnists", 0.955) == [
        "0.955 (lenet on mnist's)",
        "0.5000",
        "n/a: lenet on mnist's target, not lenet on synthetic's",
    ]
    own = TARGETS[("lenet", "synthetic")]
    assert target_row("own", own) == [str(own), "0.5000", "not reached"]
    assert target_row("yours", 0.99) == ["0.99", "0.5000", "not reached"]  # nobody's: a target of yours


def test_compare_gives_each_dataset_its_own_target_or_none_and_says_which():
    """MNIST's target stays MNIST's: the default workload on another dataset runs to that dataset's own
    target, or to none (said so); a target given is kept."""
    from distref.compare import DEFAULT_WORKLOAD, with_target
    from distref.config import with_defaults
    from distref.report import TARGETS

    def target_of(*args: str) -> tuple[str | None, str]:
        run_args, said = with_target(with_defaults(DEFAULT_WORKLOAD, list(args)))
        given = [run_args[i + 1] for i, a in enumerate(run_args) if a == "--target-accuracy"]
        assert len(given) <= 1
        return (given[0] if given else None), said

    assert target_of() == ("0.955", "target accuracy 0.955 (lenet on mnist's)")
    for (model, dataset), target in TARGETS.items():
        assert target_of("--model", model, "--dataset", dataset)[0] == str(target)
    assert len(set(TARGETS.values())) == len(TARGETS)  # (a report names a target's dataset by its value)
    target, said = target_of("--dataset", "fashion-mnist")
    assert target is None and said.startswith("no target accuracy: none is known for --model lenet")
    assert target_of("--dataset=digits", "--target-accuracy", "0.5") == ("0.5", "target accuracy 0.5 (given)")


def test_the_communication_plot_stacks_bus_bytes_as_the_table_counts_them(tmp_path, monkeypatch):
    """fsdp ×2 moves 3× ddp ×2's bytes (the all-gathers' whole outputs) but 1.5× its bus bytes, the
    measure the docs and the table's column compare strategies by: the bars and marks are bus bytes."""
    import matplotlib.axes

    drawn: dict[str, list] = {"bar": [], "scatter": [], "ylabel": []}
    for name in drawn:
        method = getattr(matplotlib.axes.Axes, "set_ylabel" if name == "ylabel" else name)

        def record(self, *args, _name=name, _method=method, **kwargs):
            drawn[_name].append((args, kwargs))
            return _method(self, *args, **kwargs)

        monkeypatch.setattr(matplotlib.axes.Axes, "set_ylabel" if name == "ylabel" else name, record)

    def bus(**kinds: tuple[int, int, float]) -> dict:
        return {k: {"calls": c, "bytes": b, "bus_bytes": u} for k, (c, b, u) in kinds.items()}

    ddp = [bus(all_reduce=(1, 87360, 87360.0))] * 2  # 2(n-1)/n = 1 of the message at n = 2
    fsdp = [bus(all_gather=(7, 172680, 86340.0), reduce_scatter=(4, 87360, 43680.0))] * 2  # (n-1)/n
    runs = [
        made_record(tmp_path / "ddp", "ddp", 2, communication=communication(ddp, ddp)),
        made_record(tmp_path / "fsdp", "fsdp", 2, communication=communication(fsdp, fsdp)),
    ]
    report = build_report(runs, tmp_path / "report").read_text()
    assert "](communication_per_step.png)" in report
    stacked = {kwargs["label"]: list(args[1]) for args, kwargs in drawn["bar"][-3:]}
    assert stacked == {
        "all_reduce": [87360 / 1024, 0.0],
        "reduce_scatter": [0.0, 43680 / 1024],
        "all_gather": [0.0, 86340 / 1024],
    }
    marks = list(drawn["scatter"][-1][0][1])  # each run's formula total, bus bytes too
    assert marks == [87360 / 1024, 130020 / 1024]
    assert drawn["ylabel"][-1][0][0] == "bus bytes (KiB) per optimizer step"
    cost = report.split("## Cost: ")[1]
    assert row_of(cost, "ddp ×2")[3] == "85.3 KiB" and row_of(cost, "fsdp ×2")[3] == "127.0 KiB"


def ran_on(run: Path, device: str, threads: int) -> Path:
    """The record in `run`, as run on `device` with `threads` threads per rank."""
    record = json.loads((run / "record.json").read_text())
    record["environment"].update(device=device, device_name=f"a {device}", threads_per_rank=threads)
    (run / "record.json").write_text(json.dumps(record))
    return run


def test_threads_per_rank_define_the_workload_on_cpu_only_and_a_failed_run_compares_nothing(tmp_path):
    """On CUDA the GPUs do the work: single with 1 thread beside ddp with 16 is one workload (the GPU
    report refused it once). On CPU the threads are the hardware: still refused. A run that failed (the
    record compare writes for one that died before its own) measured nothing: listed, not refusing."""
    single = made_record(tmp_path / "single", "single", 1)
    ddp = made_record(tmp_path / "ddp", "ddp", 2)
    report = build_report([ran_on(single, "cuda", 1), ran_on(ddp, "cuda", 16)], tmp_path / "gpu").read_text()
    speed = report.split("## Throughput and scaling")[1].split("\n## ")[0]
    assert row_of(speed, "single ×1")[1] == "1 GPU" and row_of(speed, "ddp ×2")[1] == "2 GPUs"
    assert "different workloads" not in report
    with pytest.raises(SystemExit, match=re.escape("threads per rank: single ×1=1, ddp ×2=16")):
        build_report([ran_on(single, "cpu", 1), ran_on(ddp, "cpu", 16)], tmp_path / "cpu")
    died = made_record(
        tmp_path / "died", "ddp", 2, status="failed", error="ended before writing its record: exit code 1"
    )
    report = build_report([ran_on(single, "cuda", 1), ran_on(died, "cpu", 16)], tmp_path / "died-gpu")
    failed = report.read_text().split("## Failed runs")[1].split("\n## ")[0]
    assert row_of(failed, "ddp ×2")[1] == "ended before writing its record: exit code 1"
    assert build_report([ran_on(single, "cpu", 1), died], tmp_path / "died-cpu").exists()


def test_without_matplotlib_the_report_has_every_table_and_no_plot(tmp_path, monkeypatch, capsys):
    """matplotlib is the tests' and sessions' dependency, not distref-core's: a GPU machine with no
    registry may lack it. The report is its tables: written, said why there are no plots."""
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "matplotlib" else real_find_spec(name, *a),
    )
    single = made_record(tmp_path / "single", "single", 1)
    ddp = made_record(tmp_path / "ddp", "ddp", 2)
    report = build_report([single, ddp], tmp_path / "report")
    assert "no plots: matplotlib is not installed" in capsys.readouterr().out
    assert "## Throughput and scaling" in report.read_text() and "![" not in report.read_text()
    assert not list((tmp_path / "report").glob("*.png"))


def test_on_one_gpu_compare_runs_what_fits_and_reports_pipeline_as_not_run(tmp_path, monkeypatch, capsys):
    """`nox -s compare-gpu` on one GPU (faked: the runs themselves train on this CPU): ddp runs at world size
    1, pipeline is listed as not run with why, on stdout and in the report, and compare exits 0. With
    pipeline alone asked for, nothing can run: one line and exit 1, before anything starts."""
    from distref import compare, parity

    monkeypatch.setattr(compare, "cuda_gpus", lambda: (1, "1 × a GPU"))
    stand_in = forked_subprocess()  # (its runs forked from the fork server: no interpreter to start)
    monkeypatch.setattr(compare, "subprocess", stand_in)
    monkeypatch.setattr(parity, "subprocess", forked_subprocess())
    workload = ["--model", "lenet", "--dataset", "synthetic", "--steps", "2", "--eval-every", "2"]
    workload += ["--optimizer", "sgd", "--lr", "0.01", "--global-batch-size", "32"]
    why = "needs 2 GPUs, 1 visible (1 rank: 1 ranks with --dp 1 leave 1 rank per pipeline: a pipeline needs 2 or more)"
    with pytest.raises(
        SystemExit, match=re.escape(f"none of the impls asked for can run here: pipeline: {why}")
    ):
        compare.main(
            [
                "--impls",
                "pipeline",
                "--impls-dir",
                str(ROOT / "impls"),
                *workload,
                "--out",
                str(tmp_path / "none"),
            ]
        )
    assert not (tmp_path / "none").exists()
    out = tmp_path / "out"
    compare.main(
        ["--impls", "pipeline,ddp", "--impls-dir", str(ROOT / "impls"), *workload, "--out", str(out)]
    )
    stdout = capsys.readouterr().out
    assert f"pipeline: not run ({why})" in stdout
    assert "[1/2] single (world 1)" in stdout and "[2/2] ddp (world 1)" in stdout
    assert len(stand_in.forked) == 2  # (single's and ddp's runs)
    assert load_record(out / "ddp")["status"] == "completed" and not (out / "pipeline").exists()
    report = (out / "report.md").read_text()
    not_run = report.split("## Not run\n")[1].split("\n## ")[0]
    assert row_of(not_run, "pipeline") == ["pipeline", why]


def test_a_mixture_of_experts_comparison_leaves_out_the_impls_that_do_not_train_it_and_says_why():
    """--experts: single and expert_parallel run, the others are left out saying why; without it,
    expert_parallel (made for it) is left out saying what to give."""
    from distref.compare import made_for_the_model
    from distref.impl_folders import discover

    found = discover(ROOT / "impls")
    moe = ["--model", "gpt", "--experts", "4"]
    chosen, not_run = made_for_the_model(found, ["single", "ddp", "expert_parallel"], moe)
    assert chosen == ["single", "expert_parallel"]
    assert not_run == [("ddp", "does not train gpt's mixture of experts; this workload has --experts 4")]
    chosen, not_run = made_for_the_model(found, ["single", "ddp", "expert_parallel"], ["--model", "gpt"])
    assert chosen == ["single", "ddp"]
    assert not_run == [
        ("expert_parallel", "trains gpt's mixture of experts only: give --experts E (and --model gpt)")
    ]


def test_the_routing_table_shows_each_runs_balance_beside_speed_and_parity(tmp_path):
    """Per run: the last step's tokens per expert (its most uneven layer), the worst layer's load imbalance
    (busiest ÷ mean) at the first and last step and on average, the balance loss; no table without experts."""
    from distref.report import ROUTING_TITLE, build_report

    moe = {"model": "gpt", "experts": 4, "top_k": 2}
    steps = [
        # step 0: layer 0 even (1.00), layer 1 1.50; step 1: 2.00 and 1.25; step 2: 1.00 and 3.00
        ([[96, 96, 96, 96], [144, 48, 96, 96]], 0.02),
        ([[192, 64, 64, 64], [120, 96, 96, 72]], 0.018),
        ([[96, 96, 96, 96], [288, 96, 0, 0]], 0.016),
    ]
    folder = made_record(tmp_path / "single", "single", 1, moe, samples_per_s=240.0)
    record = json.loads((folder / "record.json").read_text())
    for row, (tokens, balance) in zip(record["steps"], steps, strict=True):
        row.update(tokens_per_expert=tokens, balance_loss=balance)
    (folder / "record.json").write_text(json.dumps(record))
    dense = made_record(tmp_path / "dense", "ddp", 2, {"model": "gpt"})
    report = build_report([folder, dense], tmp_path / "report", allow_mixed=True).read_text()
    section = report.split(f"## {ROUTING_TITLE}")[1].split("\n## ")[0]
    assert row_of(section, "single ×1")[1:8] == [
        "4 × top-2",
        "288 / 96 / 0 / 0",
        "1.50",
        "3.00",
        "2.17",
        "0.0160",
        "240",
    ]
    assert "| ddp ×2 |" not in section
    assert ROUTING_TITLE not in build_report([dense], tmp_path / "dense-only").read_text()
