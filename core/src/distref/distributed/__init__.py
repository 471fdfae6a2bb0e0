"""What the multi-process impls share: starting ranks (`launch`), the process group's life
(`process_group`), collectives (`collectives`), and cutting a model into parts (`partition`)."""

from distref.distributed.agreement import check_ranks_agree
from distref.distributed.collectives import (
    all_reduce_sum,
    finish_record,
    gather_to_rank0,
    recv_tensor,
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
    "exit_without_interpreter_teardown",
    "finish_record",
    "gather_to_rank0",
    "is_collective_timeout",
    "launch_ranks",
    "recv_tensor",
    "restart_safe_store",
    "restore_environment",
    "send_tensor",
    "silent_ranks",
    "start_process_group",
    "torchrun_env",
    "without_launch_options",
]
