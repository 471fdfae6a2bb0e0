"""python -m distref.plan: which strategy for my model on my GPUs, from the formulas this project proves.

For a model (a decoder preset, one of this project's models, any nn.Module as module:function, or a bare
parameter count), a cluster (a GPU preset, its count and nodes) and a training set-up (global batch,
micro-batch, precision, optimizer, activation checkpointing), every strategy and mesh the project
implements is costed per GPU and ranked:

- **memory**: model states by `distref.cost` — in fp32 the impls' own exact formulas (`replicated`,
  `fsdp_model_states`, `zero_model_states`, `tensor_parallel_model_states`, `context_parallel_cost`,
  `expert_parallel_cost`:
  measured equal in every impl's tests, simulated equal up to 512 ranks); in mixed precision the ZeRO
  paper's bytes per parameter (`memory.mixed_precision`, checked against the paper's table). Activations by
  `cost.activations`, `cost.tp_activations` and `cost.context_parallel` (exact for gpt, lenet and resnet18
  in fp32 and under bf16 — 16-bit parameters in mixed precision, autocast's fp32 stream and 16-bit copies
  under `--precision autocast` — every pipeline schedule's order replayed), on CUDA's kernels
  (`cost.attention`: measured on the CPU's only, which the rows say); none yet for a mixture of experts
  (its presets, `mixtral-8x7b` and `olmoe-1b-7b`, are planned by expert parallelism alone, its all-to-alls
  under uniform routing, and fit by their model states, as their rows say).
- **communication** per step by `distref.cost`'s per-strategy functions, split by link: intra-node
  (NVLink/PCIe) when the group's ranks share a node, inter-node otherwise (tensor or context parallelism
  innermost, then the pipeline, data parallelism outermost).
- **time**: compute from FLOPs (PaLM's 6N + 12·L·h·s per token, arXiv 2204.02311 App. B; ×4/3 with
  activation checkpointing) at the stated utilisation of the GPU's peak (`--mfu`); communication as bus
  bytes over the link's bandwidth (nccl-tests' convention); a pipeline's bubble by its schedule's formula.
  Step time without overlap adds them; with overlap the data-parallel collectives hide under compute,
  ring attention's hops under attention's, and the tensor- and pipeline-parallel ones and Ulysses' and
  expert parallelism's all-to-alls do not. Times are a model, not a measurement: `--validate` sets them against runs.

Rows are extrapolated where a number rests on something the tests did not measure; each says which.

The package, in the order a plan is made: `model` (what is trained), `cluster` (on what, how), `layouts`
(every strategy and mesh to try), `costing` (one layout per GPU, from distref.cost), `ranking` (the plan),
`output`, `validate` (against runs' records), `simulation` (against the fake process group), `cli`.
"""

from distref.plan.cli import main
from distref.plan.cluster import GPUS, Cluster, Training
from distref.plan.costing import Row, cost
from distref.plan.layouts import Layout
from distref.plan.model import MODELS, Model, PlanError
from distref.plan.ranking import Plan, make_plan
from distref.plan.validate import render_validation, validate, validate_run

__all__ = [
    "GPUS",
    "MODELS",
    "Cluster",
    "Layout",
    "Model",
    "Plan",
    "PlanError",
    "Row",
    "Training",
    "cost",
    "main",
    "make_plan",
    "render_validation",
    "validate",
    "validate_run",
]
