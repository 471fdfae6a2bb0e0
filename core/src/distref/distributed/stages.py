"""A pipeline stage that measures itself (pipeline's bubble)."""

from __future__ import annotations

from torch.distributed.pipelining import PipelineStage

from distref.training.measure import IntervalTimer


class TimedStage(PipelineStage):
    """A PipelineStage that adds up the time it computes (forward, backward, weight gradients). The rest of
    a rank's time in `schedule.step` it waits on its neighbours or runs the schedule itself: the bubble,
    measured (the optimizer step, outside the schedule, is not counted either way). On a GPU both are
    CUDA events on the stream (IntervalTimer): a host clock sees NCCL's waits as no time."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.busy = IntervalTimer(self.device)

    def forward_one_chunk(self, *args, **kwargs):
        with self.busy.measure():
            return super().forward_one_chunk(*args, **kwargs)

    def backward_one_chunk(self, *args, **kwargs):
        with self.busy.measure():
            return super().backward_one_chunk(*args, **kwargs)

    def backward_weight_one_chunk(self, *args, **kwargs):
        with self.busy.measure():
            return super().backward_weight_one_chunk(*args, **kwargs)
