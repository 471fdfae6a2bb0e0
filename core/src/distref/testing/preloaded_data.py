"""Imported by the test suite's fork server (distref.testing.ranks.PRELOADED), after torch and distref: it
makes the data sets the suite's runs train on, once. A process keeps the sets it made
(distref.data.datasets' SAME_SET_ONCE, distref.data.mnist's _IDX_DATASETS), so every rank forked from the
server takes them made, sharing the server's pages, instead of making them again: MNIST's reading,
scaling and md5 were 0.5 s of CPU a rank (prepared here if need be), a synthetic set's 0.1 s, in
hundreds of runs. It traces their models on meta too (distref.cost.usage keeps this project's models'
Usage): 40 ms of CPU a rank for gpt.
"""

from __future__ import annotations

import contextlib

from distref.cli import parse_config, torchvision_problem
from distref.config import PARSE_TIMES
from distref.cost.usage import model_usage
from distref.data import load_dataset
from distref.data.datasets import load_digits_dataset
from distref.testing.runs import DATA_ROOT

# The sets of the suite's workloads (distref.testing.workloads, COST_RUN): lenet's and gpt's synthetic
# ones, gpt's masked targets, and real MNIST, prepared here where no test has yet (the suite's MNIST tests
# need it anyway; a fork server started before would leave every rank of that worker to load it).
WORKLOADS = [
    ["--model", "lenet", "--dataset", "synthetic"],
    ["--model", "gpt", "--dataset", "synthetic"],
    ["--model", "gpt", "--dataset", "masked"],
    ["--model", "lenet", "--dataset", "mnist", "--data-root", str(DATA_ROOT)],
]


def make_the_suite_s_data_sets() -> None:
    load_digits_dataset()  # (resnet18's BatchNorm runs: its own call, as resnet18 may lack torchvision)
    # resnet18's runs check that torchvision imports (0.2-0.5 s of CPU a rank, registering its operators):
    # imported here, where a torchvision that fails to import (PyPI's on a CPU torch) stops nothing
    torchvision_problem()
    parsed = len(PARSE_TIMES)
    try:
        for args in WORKLOADS:
            cfg = parse_config(args, "preloaded_data")
            info = load_dataset(cfg)[2]
            model_usage(cfg.model, info, cfg.gpt_layers, cfg.moe)
    finally:  # (no run began here: a forked rank's record counts its start-up from its own parse)
        del PARSE_TIMES[parsed:]


# (Neither an exception nor a refusal of parse_config's, SystemExit, may stop the fork server: where a set
# cannot be made here, each rank makes its own.)
with contextlib.suppress(Exception, SystemExit):
    make_the_suite_s_data_sets()
