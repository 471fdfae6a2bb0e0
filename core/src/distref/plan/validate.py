"""The closed loop: the plan beside runs' records (`--validate RUN_DIR…`, and after every compare)."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from distref.config import GPT_MODELS, FactoryError, MoEConfig, RunConfig, is_factory
from distref.data import DataError, DatasetInfo
from distref.distributed.partition import MODEL_DATASETS as PROJECT_DATASETS
from distref.distributed.stages import default_stages_per_rank
from distref.plan.cluster import DEFAULT_MFU, GPU, GPUS, Cluster, Training
from distref.plan.costing import cost, peak, step_flops
from distref.plan.layouts import CONTEXT_PARALLEL, Layout
from distref.plan.model import Model, PlanError, custom_model, project_model
from distref.record import not_counted

IMPL_LAYOUT = {  # impl → the layout it runs, from its record (world size, its options)
    "single": lambda world, o: Layout("ddp", dp=1),
    "ddp": lambda world, o: Layout("ddp", dp=world),
    "fsdp": lambda world, o: (
        Layout("hsdp", dp=world, shard=world // o["hsdp"])
        if o.get("hsdp", 1) > 1
        else Layout("fsdp", dp=world)
    ),
    "deepspeed_zero": lambda world, o: Layout(f"zero{o['zero_stage']}", dp=world),
    "tensor_parallel": lambda world, o: tensor_parallel_layout(world, o.get("dp_shard"), o.get("tp")),
    "context_parallel": lambda world, o: context_parallel_layout(world, o),
    "expert_parallel": lambda world, o: Layout("ep", dp=world, ep=o.get("ep") or world),  # (--ep: the world)
    "pipeline": lambda world, o: Layout(
        f"pp-{o['schedule']}",
        dp=o["dp"],
        pp=world // o["dp"],
        # (pipeline 0.10 records the schedule's default too: a layout names it only where it differs)
        stages_per_rank=None
        if o.get("stages_per_rank") == default_stages_per_rank(o["schedule"])
        else o.get("stages_per_rank"),
        partition=o.get("partition"),
    ),
    # --devices: one process drives every part, and what it holds is the whole model's (planned as one
    # part); otherwise one process per part
    "model_parallel": lambda world, o: (
        Layout("model_parallel", pp=1)
        if o.get("devices")
        else Layout("model_parallel", pp=world, partition=o.get("partition"))
    ),
}


# Options the plan takes at their defaults: a run that changed one is compared, and the result says so
PLANNED_AS = {
    "ddp": {"comm_hook": "none"},
    "fsdp": {"cpu_offload": False},  # (and reshard_after_forward as the run's shard group: validate_run)
    "deepspeed_zero": {"offload_optimizer": False, "offload_params": False},
    "tensor_parallel": {"sequence_parallel": True, "loss_parallel": True},
}


def tensor_parallel_layout(world: int, dp: int | None, tp: int | None) -> Layout:
    """impls/tensor_parallel's mesh (its `mesh_shape`): the degree not given fills the world; neither
    given, one tensor-parallel group."""
    if tp is None:
        dp = dp or 1
        return Layout("tp", dp=dp, tp=max(1, world // dp))
    return Layout("tp", dp=dp or max(1, world // tp), tp=tp)


def context_parallel_layout(world: int, options: dict[str, Any]) -> Layout:
    """impls/context_parallel's mesh (its `mesh_shape`: the degree not given fills the world; neither
    given, one context-parallel group) and attention (--cp-mode)."""
    dp, cp = options.get("dp_shard"), options.get("cp")
    if cp is None:
        dp = dp or 1
        cp = max(1, world // dp)
    else:
        dp = dp or max(1, world // cp)
    return Layout("cp-ulysses" if options.get("cp_mode") == "ulysses" else "cp", dp=dp, cp=cp)


def recorded_routing(record: dict[str, Any], layout: Layout) -> tuple[tuple[int, ...] | None, str]:
    """The rows rank 0's experts received in the run's counted step, per MoE layer, from the record's
    tokens per expert (summed over every rank: rank 0's group's alone where one group holds every expert,
    ep = world), and what the validation line says of it; None where the record cannot tell (the plan's
    uniform routing)."""
    counted = (record.get("communication") or {}).get("step")
    steps = [row for row in record.get("steps", []) if row.get("step") == counted]
    per_expert = steps[0].get("tokens_per_expert") if steps else None
    if layout.ep != layout.dp or per_expert is None:
        why = "its tokens per expert sum every group's" if per_expert is not None else "no routing recorded"
        return None, f"all-to-alls under uniform routing ({why} for the counted step)"
    held = len(per_expert[0]) // layout.ep  # rank 0 holds experts 0 … E/ep − 1
    received = tuple(sum(layer[:held]) for layer in per_expert)
    return (
        received,
        f"all-to-alls as the counted step (step {counted}) routed: rank 0's experts received {sum(received):,} rows",
    )


def dataset_info(config: dict[str, Any]) -> DatasetInfo:
    """The DatasetInfo a run's model was built for, from its record's config: a named dataset's without
    reading it; a text file's or a dataset of yours read again (DataError where it is gone)."""
    from distref.data.datasets import NAMED_DATASET_SAMPLES, sample_batch

    model, dataset = config["model"], config["dataset"]
    if dataset == "synthetic" and model in GPT_MODELS:  # (synthetic makes each its inputs)
        # --sequence-length (core 0.18.0 on): the tokens of each sequence, else the task's own
        sequence = config.get("sequence_length")
        info = PROJECT_DATASETS[model]
        return dataclasses.replace(info, input_shape=(sequence,)) if sequence else info
    if dataset == "synthetic" and model == "resnet18":
        return DatasetInfo("synthetic", 10, (3, 32, 32), "image")
    if dataset in NAMED_DATASET_SAMPLES:
        return NAMED_DATASET_SAMPLES[dataset]
    fields = {f.name for f in dataclasses.fields(RunConfig)}
    return sample_batch(RunConfig(**{k: v for k, v in config.items() if k in fields and k != "strategy"}))[2]


def record_model(config: dict[str, Any]) -> Model:
    """The model a run's record says it trained, as built for its dataset (its classes, its inputs);
    a model of yours (MODULE:FUNCTION) built again on the meta device."""
    info = dataset_info(config)
    if is_factory(config["model"]):
        return custom_model(config["model"], info.input_shape, info.kind == "sequence")
    # (--experts, core 0.19.0 on: gpt's MLPs mixtures of experts)
    moe = MoEConfig(config["experts"], config["top_k"]) if config.get("experts") else None
    model = project_model(config["model"], info, config["gpt_layers"], moe)
    return dataclasses.replace(model, name=f"{config['model']} ({info.name})")


def validate(run_dirs: Sequence[Path]) -> list[dict[str, Any]]:
    """Each run's record beside the plan for the same model, layout and batch (`validate_run`)."""
    results = []
    for run_dir in run_dirs:
        path = Path(run_dir) / "record.json"
        if not path.is_file():
            raise PlanError(f"{run_dir}: no record.json in it (give the --out folder of a run)")
        try:
            record = json.loads(path.read_text())
            results.append({"run": str(run_dir), **validate_run(record)})
        except PlanError as e:
            raise PlanError(f"{path}: {e}") from None
        except (ValueError, KeyError, TypeError, IndexError, AttributeError, ArithmeticError) as e:
            raise PlanError(
                f"{path} is not a run record this plan can read ({type(e).__name__}: {e})"
            ) from None
    return results


def validate_run(record: dict[str, Any]) -> dict[str, Any]:
    """[measured, planned] model states, activations and communication (bus bytes) of the run's rank 0 (a
    pipeline's: the plan's fullest rank), and its step time; on CPU, the plan's FLOPs over the measured
    time say what utilisation of the peak the run reached. {"skipped": why} where the plan has none, or the
    session measured nothing (resumed with no steps left); communication not compared where no steady step
    was counted ("not_counted": why; distref.record.not_counted)."""
    impl, config, world = record["impl"]["name"], record["config"], record["world_size"]
    if impl not in IMPL_LAYOUT:
        why = "nn.DataParallel: one process" if impl == "dataparallel" else "not one of this project's impls"
        return {"impl": impl, "skipped": f"no layout for impl {impl!r} ({why})"}
    if record.get("status") != "completed":
        return {"impl": impl, "skipped": f"the run did not complete (status {record.get('status')!r})"}
    resumes = record.get("resumes") or []
    if resumes and not any(row["step"] >= resumes[-1]["step"] for row in record["steps"]):
        return {
            "impl": impl,
            "skipped": f"resumed at step {resumes[-1]['step']} with no steps left: this session measured nothing",
        }
    for name in ("model_state_bytes", "activation_bytes", "communication"):
        per_rank = record.get(name)
        per_rank = per_rank.get("measured") if isinstance(per_rank, dict) else per_rank
        if per_rank is not None and len(per_rank) != world:
            raise PlanError(f"its {name} holds {len(per_rank)} ranks, its world_size says {world}")
    options = config.get("extra") or {}
    if impl == "fsdp":  # what the run did (by default since fsdp 0.9: resharded with 2+ shards only)
        resharded = (record.get("strategy") or {}).get("reshard_after_forward")
        options = {**options, "reshard_after_forward": resharded}
    if impl == "fsdp" and world % (options.get("hsdp") or 1):
        raise PlanError(f"--hsdp {options['hsdp']} does not divide its {world} ranks")
    notes = []
    # bf16/fp16: the impls keep fp32 states and compute in 16 bits under autocast (FSDP2's policy gathers
    # 16-bit parameters); DeepSpeed alone trains 16-bit parameters with fp32 master copies, the ZeRO
    # paper's mixed precision
    precision = config["precision"]
    if precision in ("bf16", "fp16"):  # (each strategy's activations as its impl computes: Training.saving)
        precision = "mixed" if impl == "deepspeed_zero" else "autocast"
        notes.append(
            f"--precision {config['precision']}: "
            + (
                "DeepSpeed's 16-bit parameters and fp32 master copies planned by the ZeRO paper's bytes "
                "per parameter (DeepSpeed's gradient partitions, by whole parameters, and padding left out: "
                "within 0.2% at stage 3, 10-20% at stages 1-2; the record's own formula is exact)"
                if precision == "mixed"
                else "fp32 states, 16-bit compute under autocast"
                + (
                    " (FSDP2's policy: 16-bit parameters and inputs)"
                    if impl in ("fsdp", "context_parallel")
                    else ""
                )
            )
        )
    elif precision not in ("fp32", "fp64"):
        return {"impl": impl, "skipped": f"--precision {precision}: the plan has no formula for it"}
    if impl == "tensor_parallel" and is_factory(config["model"]):
        return {
            "impl": impl,
            "skipped": f"--model {config['model']}: tensor parallelism by a tp_plan has no formula (gpt's only)",
        }
    if impl == "context_parallel" and config["model"] not in GPT_MODELS:  # (its check refuses others)
        return {
            "impl": impl,
            "skipped": f"--model {config['model']}: context parallelism splits gpt's sequences",
        }
    if impl == "expert_parallel" and config["model"] not in GPT_MODELS:  # (its check refuses others)
        return {
            "impl": impl,
            "skipped": f"--model {config['model']}: expert parallelism spreads gpt's experts",
        }
    if impl == "model_parallel" and options.get("devices"):
        notes.append(f"--devices {options['devices']}: one process holds every part; planned as one part")
    try:
        model = record_model(config)
    except (DataError, FactoryError, PlanError) as e:
        return {"impl": impl, "skipped": f"its model or data cannot be built here: {e}"}
    training = Training(
        global_batch=config["global_batch_size"],
        micro_batch=1,
        precision=precision,
        optimizer=config["optimizer"],
        checkpointing=config["activation_checkpointing"],
        mfu=DEFAULT_MFU,
        grad_accum=options.get("microbatches") or config["grad_accum"],  # (a pipeline's: its micro-batches)
        device="cpu" if record["environment"]["device"] == "cpu" else "cuda",
    )
    gpu = GPUS["cpu"] if record["environment"]["device"] == "cpu" else gpu_named(record["environment"])
    layout = IMPL_LAYOUT[impl](world, options)
    if impl == "expert_parallel" and layout.ep > 1:
        routed, said = recorded_routing(record, layout)
        layout = dataclasses.replace(layout, routed_rows=routed)
        notes.append(said)
    row = cost(layout, model, Cluster(gpu, world), training)
    rank = row.pipeline_rank or 0
    states = (record.get("model_state_bytes") or {rank: None})[rank]
    communication = ((record.get("communication") or {}).get("measured") or {rank: None})[rank]
    activations = ((record.get("activation_bytes") or {}).get("measured") or {rank: None})[rank]
    if uncounted := not_counted(record):  # (a first or second step's communication is not the plan's)
        communication = None
    step_s = config["global_batch_size"] / record["samples_per_s"] if record.get("samples_per_s") else None
    flops = step_flops(model, training, world)
    defaults = dict(PLANNED_AS.get(impl, {}))
    if impl == "fsdp":  # (the plan reshards as impls/fsdp does by default: with 2+ shards)
        defaults["reshard_after_forward"] = world // (options.get("hsdp") or 1) > 1
    planned_as = {
        option: planned for option, planned in defaults.items() if options.get(option, planned) != planned
    }
    if (
        row.strategy in ("fsdp", "hsdp", "tp", *CONTEXT_PARALLEL)
        and row.grad_accum > 1
        and (row.strategy != "tp" or row.layout.dp > 1)
    ):
        notes.append(
            "gradients: the plan gives their peak, whole while micro-steps accumulate; the record measures them "
            "sharded, after the step"
        )
    return {
        "impl": impl,
        "layout": f"{row.strategy} {row.mesh}",
        "rank": rank,
        "not_planned": [f"{option}={options[option]}" for option in planned_as],  # the run's values
        "planned_as": [f"{option}={planned}" for option, planned in planned_as.items()],
        "notes": notes,
        "model_states": [sum(states.values()) if states else None, row.memory_per_gpu_bytes["model_states"]],
        "activations": [activations, row.memory_per_gpu_bytes["activations"]],
        "communication_bus_bytes": [
            sum(entry.get("bus_bytes", 0) for entry in communication.values())
            if communication is not None
            else None,
            sum(row.communication_bytes.values()),
        ],
        "step_s": [step_s, row.step_s["overlap"]],
        "implied_mfu": flops / (peak(gpu, training.precision) * step_s) if flops and step_s else None,
        "not_counted": uncounted,
    }


def gpu_named(environment: dict[str, Any]) -> GPU:
    """The preset of a record's GPU, by its name ("NVIDIA H100 80GB HBM3", "NVIDIA L4"); others: H100's
    figures under the record's name."""
    name = (environment.get("device_name") or "").lower()
    if "h100" in name:
        return GPUS["h100-80gb"]
    if "a100" in name:
        return GPUS["a100-40gb" if "40gb" in name.replace(" ", "") else "a100-80gb"]
    if re.search(r"\bl4\b", name):
        return GPUS["l4"]
    return dataclasses.replace(GPUS["h100-80gb"], name=environment.get("device_name") or "GPU")


def render_validation(results: list[dict[str, Any]]) -> str:
    """One line per run: measured vs planned, planned ÷ measured in brackets."""

    def pair(values, fmt) -> str:
        measured, planned = values
        if measured is None or planned is None:
            return f"{fmt(measured)} vs {fmt(planned)}"
        if planned == measured:
            return f"{fmt(measured)} vs {fmt(planned)} (1.000×, exact)"
        ratio = planned / measured if measured else math.inf
        difference = planned - measured
        return f"{fmt(measured)} vs {fmt(planned)} ({ratio:.4f}×, {'+' if difference > 0 else ''}{fmt(difference)})"

    def size(n) -> str:
        return "—" if n is None else f"{n:,.0f} B"

    def secs(n) -> str:
        return "—" if n is None else f"{n:.3f} s"

    lines = ["measured vs planned (rank 0, a pipeline's fullest rank; planned ÷ measured in brackets)"]
    for r in results:
        if "skipped" in r:
            lines.append(f"{r['run']} ({r['impl']}): skipped: {r['skipped']}")
            continue
        mfu = "—" if r["implied_mfu"] is None else f"{r['implied_mfu']:.1%}"
        activations = f"activations {pair(r['activations'], size)}"
        communication = f"communication {pair(r['communication_bus_bytes'], size)} bus bytes"
        if uncounted := r.get("not_counted"):  # (said, not compared)
            communication = f"communication not counted ({uncounted})"
            if r["activations"][0] is None:
                activations = "activations not counted"
        lines.append(
            f"{r['run']} ({r['impl']}, {r['layout']}, rank {r['rank']}): model states {pair(r['model_states'], size)}; "
            f"{activations}; {communication}; step {pair(r['step_s'], secs)}, implied MFU {mfu}"
            + (
                f" (planned with {', '.join(r['planned_as'])}; the run had {', '.join(r['not_planned'])})"
                if r["not_planned"]
                else ""
            )
            + "".join(f"; {note}" for note in r["notes"])
        )
    return "\n".join(lines)
