"""What the multi-process impls share: starting ranks (`launch`), the process group's life
(`process_group`), collectives (`collectives`), cutting a model into parts (`partition`), a pipeline's
stages and their meter (`stages`), and model parallelism's hand-overs measured (`handoffs`)."""

from distref.distributed.agreement import check_ranks_agree
from distref.distributed.collectives import (
    all_reduce_sum,
    evaluate_gathered,
    finish_record,
    gather_to_rank0,
    recv_tensor,
    save_whole_state,
    send_tensor,
)
from distref.distributed.launch import (
    SHUTDOWN_TIMEOUT_S,
    launch_ranks,
    restore_environment,
    torchrun_env,
    without_launch_options,
)
from distref.distributed.process_group import (
    SILENT_RANK_WAIT_S,
    destroy_process_group_on_exit,
    exit_without_interpreter_teardown,
    is_collective_timeout,
    restart_safe_store,
    silent_ranks,
    start_process_group,
)

__all__ = [
    "SHUTDOWN_TIMEOUT_S",
    "SILENT_RANK_WAIT_S",
    "all_reduce_sum",
    "check_ranks_agree",
    "destroy_process_group_on_exit",
    "evaluate_gathered",
    "exit_without_interpreter_teardown",
    "finish_record",
    "gather_to_rank0",
    "is_collective_timeout",
    "launch_ranks",
    "recv_tensor",
    "restart_safe_store",
    "restore_environment",
    "save_whole_state",
    "send_tensor",
    "silent_ranks",
    "start_process_group",
    "torchrun_env",
    "without_launch_options",
]
