"""The run record: what a run measured, in a versioned schema (record.schema.json beside this file).

Rank 0 owns the record. Steps stream to `steps.jsonl` as they are flushed; `record.json` is written
atomically at the end (and on failure, with status "failed" and the error). A resumed run restores the
record's state from the checkpoint, so the final record covers the whole run.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import resource
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from distref.config import PARSE_TIMES, RunConfig, under_torchrun
from distref.cost import FORMULAS
from distref.provenance import git_sha
from distref.schedulers import scheduler_info

SCHEMA_VERSION = 1
# The step of a session whose communication and activations are counted (0-based; distref.training.traffic):
# its first builds the optimizer's state and pipelining's shapes, its second DDP's rebuilt buckets (whose
# layout rank 0 broadcasts) and ZeRO-3's check of its fetch trace across ranks; the third is steady.
COUNTED_SESSION_STEP = 2
SCHEMA_PATH = Path(__file__).with_name("record.schema.json")


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process: max allocated by torch on GPU, max resident set size on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class TrainingPeakMemory:
    """The most memory training held on each device a rank computes on. On CUDA: torch's peak allocation,
    reset when set-up ends (`start`), taken before each evaluation (`before_evaluation`) and reset after
    it, so that neither set-up nor an evaluation's test-set batches count as training's. On the CPU: the
    process's max resident set size, which cannot be reset (set-up and evaluation count)."""

    def __init__(self, devices: list[torch.device]):
        self.devices = devices
        self.peaks = [0] * len(devices)

    def _cuda(self) -> list[tuple[int, torch.device]]:
        return [(i, d) for i, d in enumerate(self.devices) if d.type == "cuda"]

    def start(self) -> None:
        for _, device in self._cuda():
            torch.cuda.reset_peak_memory_stats(device)

    def before_evaluation(self) -> None:
        for i, device in self._cuda():
            self.peaks[i] = max(self.peaks[i], int(torch.cuda.max_memory_allocated(device)))

    def after_evaluation(self) -> None:
        self.start()

    def bytes(self) -> list[int]:
        """Per device, the peak so far."""
        self.before_evaluation()  # (the peak since the last evaluation counts too)
        return [
            peak if d.type == "cuda" else peak_memory_bytes(d)
            for peak, d in zip(self.peaks, self.devices, strict=True)
        ]


_IMPORTED_AT = time.perf_counter()


def run_start() -> float:
    """When this run started, in time.perf_counter(), so that start-up counts what the user waited for:
    - a rank started by `python train.py --nproc-per-node N` (its first attempt): the launcher's start,
      which it passes on (DISTREF_LAUNCHED_AT, seconds since the epoch): its imports and checks count;
    - a process started to run a train.py (`python train.py`, torchrun's ranks, a restarted rank): its
      own start, the interpreter and imports included;
    - main() called in a process that does other things (a notebook, a test): the parse_config call that
      began this run."""
    first_run = len(PARSE_TIMES) <= 1
    launched = os.environ.get("DISTREF_LAUNCHED_AT")
    if (
        first_run
        and launched
        and under_torchrun()
        and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    ):
        return time.perf_counter() - (time.time() - float(launched))
    if first_run and Path(sys.argv[0]).name == "train.py":
        return time.perf_counter() - seconds_since_process_start()
    return PARSE_TIMES[-1] if PARSE_TIMES else time.perf_counter()


def process_started_at() -> float:
    """This process's start, in seconds since the epoch (for DISTREF_LAUNCHED_AT)."""
    return time.time() - seconds_since_process_start()


def seconds_since_process_start() -> float:
    """How long this process has run: from its start time in /proc (Linux: clock ticks after boot, beside
    the uptime), so that start-up counts the interpreter, imports and all; elsewhere since this module
    was imported."""
    try:
        after_name = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started_ticks = int(after_name[19])  # field 22, starttime; the fields after the name start at 3
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - _IMPORTED_AT


def cpu_name() -> str:
    """The CPU model (Linux /proc/cpuinfo), else what platform knows, else "cpu"."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def environment(device: torch.device, backend: str) -> dict[str, Any]:
    return {
        "git_sha": git_sha(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": device.type,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name(),
        "backend": backend,
        "hostname": socket.gethostname(),
        "cpu_count": os.cpu_count() or 1,
        "gpu_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "threads_per_rank": torch.get_num_threads(),
        "scheduler": scheduler_info(),  # the SLURM job (id, nodes, how it was launched), or None
        # each rank's node, by rank: SLURM's node name where there is one (two nodes may share a host)
        "rank_nodes": [node_name()],
    }


def node_name() -> str:
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


class RunRecord:
    """Collects a run's measurements; `write()` produces record.json. Only rank 0 keeps one."""

    def __init__(
        self,
        impl: str,
        version: str,
        cfg: RunConfig,
        world_size: int,
        device: torch.device,
        backend: str,
        write_files: bool = True,
        devices: int | None = None,
        memory_devices: list[torch.device] | None = None,
    ):
        # Every rank may keep a record (same numbers); only the one with write_files touches --out.
        self.out = Path(cfg.out) if cfg.out and write_files else None
        self.data: dict[str, Any] = {
            "schema_version": SCHEMA_VERSION,
            "status": "failed",  # until finish() says otherwise
            "error": None,
            "impl": {"name": impl, "version": version},
            "environment": environment(device, backend),
            "world_size": world_size,
            "devices": devices or world_size,  # devices that compute (DataParallel: GPUs of one process)
            "config": cfg.to_dict(),
            "steps": [],
            "skipped_steps": [],
            "evals": [],
            "samples_per_s": None,
            "train_time_s": None,
            "eval_time_s": None,
            "peak_memory_bytes": [],
            "model_state_bytes": [],
            "model_state_bytes_predicted": None,
            "communication": None,
            "activation_bytes": None,
            "strategy": {},
            "target_accuracy": cfg.target_accuracy,
            "time_to_target_s": None,
            "final_accuracy": None,
            "resumes": [],
            "startup_time_s": None,
            "wall_time_s": 0.0,
            "started_at": _now(),
            "finished_at": None,
        }
        # Three clocks, each summed over the sessions of a resumed run. Wall time runs from the run's start
        # (the process's: run_start); start-up from there to the first step (imports, data, model,
        # process group, engine); the run's clock (evaluations' elapsed_s, time to target) from the
        # first step on, as MLPerf's starts at the end of initialisation. start_training() divides them.
        self._run_start = run_start()
        self._wall_before = self._elapsed_before = self._startup_before = 0.0
        self._session_start = self._run_start  # until start_training()
        # Training's peak memory on each device this rank computes on (model_parallel --devices: several).
        self.memory = TrainingPeakMemory(memory_devices or [device])
        # --out is made when the first file is written: a run refused before then (a checkpoint of another
        # run) leaves no empty folder behind.

    # -- time ---------------------------------------------------------------------------------------
    def start_training(self) -> None:
        """Set-up is done and the first step of this session begins: start-up ends, the run's clock starts."""
        self._session_start = time.perf_counter()
        self.data["startup_time_s"] = self._startup_before + self._session_start - self._run_start
        self.memory.start()  # set-up's allocations are not training's

    def elapsed(self) -> float:
        """The run's clock: seconds since the first step, summed over sessions (start-ups left out)."""
        return self._elapsed_before + time.perf_counter() - self._session_start

    def wall_time(self) -> float:
        """Seconds since the process started, summed over sessions (start-ups included)."""
        return self._wall_before + time.perf_counter() - self._run_start

    # -- measurements -------------------------------------------------------------------------------
    def add_steps(
        self,
        first_step: int,
        losses: list[float],
        step_times: list[float],
        routing: list[dict[str, Any]] | None = None,
    ) -> None:
        """Steps' losses and times, flushed every --log-every steps and before every evaluation (every impl
        flushes when an evaluation is due): the training peak memory so far is taken here too. `routing`:
        a mixture of experts' per step ({"balance_loss", "tokens_per_expert": layers × experts})."""
        self.memory.before_evaluation()
        rows = [
            {"step": first_step + i, "loss": loss if math.isfinite(loss) else None, "step_time_s": t}
            for i, (loss, t) in enumerate(zip(losses, step_times, strict=True))
        ]
        for row, routed in zip(rows, routing or [], strict=False):
            row.update(routed)
        self.data["steps"].extend(rows)
        if self.out:
            with open(self._file("steps.jsonl"), "a") as f:
                f.writelines(json.dumps(row) + "\n" for row in rows)

    def add_strategy_facts(self, **facts: Any) -> None:
        """What the strategy did that the options do not say (its cut points, its DeepSpeed version, its
        measured bubble): the record's "strategy" object."""
        self.data["strategy"].update(facts)

    def set_communication(self, counted_per_rank: list[dict[str, Any]]) -> None:
        """What each rank communicated and held for backward in its counted step (distref.training.traffic's
        summary: the step, its phases, its saved activations); `finish` adds what the formulas predict."""
        steps = {c["step"] for c in counted_per_rank}
        step = steps.pop() if len(steps) == 1 else None
        # (none counted: a session of fewer than 3 steps, every rank saying why)
        why = next((c["not_counted"] for c in counted_per_rank if c.get("not_counted")), None)
        self.data["communication"] = {
            "step": step,
            "not_counted": why if step is None else None,
            "measured": [c["phases"].get("step") for c in counted_per_rank],
            "predicted": None,
            "phases": {
                phase: [c["phases"].get(phase) for c in counted_per_rank]
                for phase in ("setup", "log", "eval", "checkpoint")
            },
            "counting_overhead_s": None,
        }
        self.data["activation_bytes"] = {
            "measured": [c.get("activation_bytes") for c in counted_per_rank],
            "predicted": None,
        }

    def set_bubble_fraction(self, fraction: float) -> None:
        """The share of the run a pipeline's stages sat idle (report column; null for other strategies)."""
        self.data["bubble_fraction"] = fraction

    def add_schedule_measurements(self, measured: dict[str, Any] | None) -> None:
        """A pipeline's schedule as every rank measured it (distref.distributed.stages.StageMeter.gathered:
        None on the ranks that do not write the record): busy shares, activations held and timelines as
        strategy facts, the bubble as the report's column."""
        if measured is None:
            return
        facts = dict(measured)
        if (bubble := facts.pop("bubble_fraction")) is not None:
            self.set_bubble_fraction(bubble)
        self.add_strategy_facts(**facts)

    def add_skipped_step(self, step: int) -> None:
        """Optimizer step `step` (numbered as in "steps") changed nothing: fp16's loss scaler found inf/nan
        in its gradients, skipped the update and lowered the scale. A few at the start are normal (the
        scale is searched down from 2**16); many in a row mean the run is not learning."""
        self.data["skipped_steps"].append(step)

    def add_eval(self, step: int, epoch: float, accuracy: float, loss: float, seconds: float) -> None:
        """An evaluation after `step` steps that took `seconds`; its elapsed time is the run's at its end."""
        self.memory.after_evaluation()  # what it allocated is not training's
        elapsed = self.elapsed()
        self.data["evals"].append(
            {
                "step": step,
                "epoch": epoch,
                "elapsed_s": elapsed,
                "eval_time_s": seconds,
                "accuracy": accuracy,
                "loss": loss,
            }
        )
        self.data["final_accuracy"] = accuracy
        self._time_to_target()

    def _time_to_target(self) -> None:
        """Elapsed time at the first eval at or above the target (None until one is): derived from the
        evals alone, so a target given or changed on resume is judged over the whole history."""
        target = self.data["target_accuracy"]
        reached = [
            e["elapsed_s"] for e in self.data["evals"] if target is not None and e["accuracy"] >= target
        ]
        self.data["time_to_target_s"] = reached[0] if reached else None

    def training_peak_memory(self) -> list[int]:
        """This rank's training peak memory, per device it computes on (TrainingPeakMemory)."""
        return self.memory.bytes()

    def finish(
        self,
        global_batch_size: int,
        peak_memory_per_rank: list[int],
        model_state_per_rank: list[dict[str, int] | None] | None = None,
        predicted_per_rank: list[dict[str, Any]] | None = None,
    ) -> None:
        """The run is done: its throughput, memory and model states, written as record.json. Beside what
        was measured, what the strategy's formulas predict for each rank (distref.cost.Predicted.as_dict:
        communication, model states, activations)."""
        steps = self.data["steps"]
        counted = (self.data["communication"] or {}).get("step")  # (slower: every operation through Python)
        # step 0 pays for warm-up (allocations, caches), the counted step for counting
        timed = [row["step_time_s"] for row in steps[1:] if row["step"] != counted]
        if timed and sum(timed) > 0:
            self.data["samples_per_s"] = global_batch_size * len(timed) / sum(timed)
        self.data["train_time_s"] = sum(row["step_time_s"] for row in steps)
        self.data["eval_time_s"] = sum(e.get("eval_time_s", 0.0) for e in self.data["evals"])
        self.data["peak_memory_bytes"] = [int(m) for m in peak_memory_per_rank]
        self.data["model_state_bytes"] = [s for s in model_state_per_rank or [] if s is not None]
        self._set_predicted(predicted_per_rank or [])
        self._counting_overhead()
        if self.data["config"].get("compile"):  # (that --compile took effect: the graphs dynamo made here)
            self.data["strategy"]["compiled_graphs"] = compiled_graphs()
        self.data["status"] = "completed"
        self.write()

    def _set_predicted(self, per_rank: list[dict[str, Any]]) -> None:
        """Each formula's numbers, per rank, where every rank has one (else the record keeps null)."""

        def every_rank(key: str) -> list | None:
            values = [p[key] for p in per_rank]
            return values if values and all(v is not None for v in values) else None

        self.data["model_state_bytes_predicted"] = every_rank("model_states")
        if self.data["communication"] is not None:
            self.data["communication"]["predicted"] = every_rank("communication")
        if self.data["activation_bytes"] is not None:
            self.data["activation_bytes"]["predicted"] = every_rank("activations")
        # Where a formula is missing, why: the first reason a rank gives (Predicted.unavailable)
        reasons = {}
        for key in FORMULAS:
            given = [p["unavailable"][key] for p in per_rank if key in p.get("unavailable", {})]
            if every_rank(key) is None and given:
                reasons[key] = given[0]
        self.data["predicted_unavailable"] = reasons

    def _counting_overhead(self) -> None:
        """What counting communication cost: the counted step's time minus the median of this session's
        other steps but its first (warm-up: allocations, caches, DDP's buckets). The counted step is the
        session's third (or its last): its first is two steps before it, at most."""
        communication = self.data["communication"]
        if not communication or communication["step"] is None:
            return
        times = {row["step"]: row["step_time_s"] for row in self.data["steps"]}
        counted = times.pop(communication["step"], None)
        session_first = max(communication["step"] - 2, min(times, default=0))
        others = sorted(t for step, t in times.items() if step > session_first)
        if counted is not None and others:
            communication["counting_overhead_s"] = counted - statistics.median(others)

    def fail(self, error: str) -> None:
        self.data["status"] = "failed"
        self.data["error"] = error
        self.write()

    def write(self) -> Path | None:
        self.data["wall_time_s"] = self.wall_time()
        self.data["finished_at"] = _now()
        if not self.out:
            return None
        path = self._file("record.json")
        tmp = path.with_name(f".record.json.tmp{os.getpid()}")
        tmp.write_text(json.dumps(self.data, indent=1) + "\n")
        os.replace(tmp, path)
        return path

    def _file(self, name: str) -> Path:
        """`name` under --out, the folder made if it is not there yet."""
        self.out.mkdir(parents=True, exist_ok=True)
        return self.out / name

    # -- resume -------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps so that a resumed run's record covers the whole run."""
        return {
            "steps": list(self.data["steps"]),
            "skipped_steps": list(self.data["skipped_steps"]),
            "evals": list(self.data["evals"]),
            "final_accuracy": self.data["final_accuracy"],
            "resumes": list(self.data["resumes"]),
            "elapsed_s": self.elapsed(),
            "startup_s": self.data["startup_time_s"] or 0.0,
            "wall_s": self.wall_time(),
            "started_at": self.data["started_at"],
        }

    def load_state(self, checkpoint: dict[str, Any], path: str | Path) -> None:
        """Continue the record kept in `checkpoint` (from load_checkpoint), noting this resume and the
        options it changes, so that the record describes the run as it really went."""
        state = checkpoint["record"]
        for key in ("steps", "evals", "final_accuracy", "started_at"):
            self.data[key] = state[key]
        # Steps skipped before the checkpoint; those after it are made again (checkpoints before 0.4.1 lack it).
        self.data["skipped_steps"] = [s for s in state.get("skipped_steps", []) if s < checkpoint["step"]]
        self.data["resumes"] = [
            *state.get("resumes", []),
            {"step": checkpoint["step"], "checkpoint": str(path), "changes": checkpoint["changes"]},
        ]
        self._time_to_target()
        # (Checkpoints before core 0.7.0 kept the run's clock alone, start-ups included.)
        self._elapsed_before = float(state["elapsed_s"])
        self._startup_before = float(state.get("startup_s", 0.0))
        self._wall_before = float(state.get("wall_s", state["elapsed_s"]))
        if self.out:  # steps logged after the checkpoint by the interrupted session are dropped
            with open(self._file("steps.jsonl"), "w") as f:
                f.writelines(json.dumps(row) + "\n" for row in self.data["steps"])


def not_counted(record: dict[str, Any]) -> str | None:
    """Why a record holds no steady step's communication and activations to set beside the formulas, or
    None: its session ran fewer than 3 steps and counted none (the record says why), or, in a record from
    before that rule, the step it counted was its session's first or second."""
    communication = record.get("communication") or {}
    step = communication.get("step")
    if step is None:
        return communication.get("not_counted")
    resumes = record.get("resumes") or []
    first = resumes[-1]["step"] if resumes else 0  # (the session's first step)
    if step - first < COUNTED_SESSION_STEP:
        which = ("first", "second")[max(step - first, 0)]
        return f"step {step}, its session's {which}, is not a steady one: a session's third is"
    return None


def load_record(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if path.is_dir():
        path = path / "record.json"
    data = json.loads(path.read_text())
    if data.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(
            f"{path}: record schema {data.get('schema_version')}, this distref reads {SCHEMA_VERSION}"
        )
    return data


def print_summary(data: dict[str, Any], file=None) -> None:
    """One line for the console at the end of a run (to sys.stdout as it is now, not at import)."""
    acc, sps, ttt = data["final_accuracy"], data["samples_per_s"], data["time_to_target_s"]
    parts = [
        f"{data['impl']['name']} {data['impl']['version']}: {data['status']}",
        f"accuracy {acc:.4f}" if acc is not None else "accuracy n/a",
        f"{sps:,.0f} samples/s" if sps else "samples/s n/a",
        f"peak mem {max(data['peak_memory_bytes'] or [0]) / 2**20:,.0f} MiB/rank",
        f"wall {data['wall_time_s']:.1f}s",
    ]
    if data.get("startup_time_s") is not None:
        parts[-1] += f" (start-up {data['startup_time_s']:.1f}s)"
    if data.get("skipped_steps"):
        parts.append(f"{len(data['skipped_steps'])} steps skipped (fp16 overflow)")
    if data["target_accuracy"] is not None:
        reached = f"at {ttt:.1f}s" if ttt is not None else "not reached"
        parts.append(f"target {data['target_accuracy']} {reached}")
    print(" | ".join(parts), file=file or sys.stdout)


def compiled_graphs() -> int:
    """The graphs torch.compile has made in this process so far (dynamo's own count)."""
    from torch._dynamo.utils import counters  # (local: importing dynamo costs ~1 s, only --compile pays)

    return int(counters["stats"]["unique_graphs"])
