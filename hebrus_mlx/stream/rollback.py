"""The step guard every evaluation of generation runs under (AFN-010). What it adds over restoring
the cache is streaming's: a streamed read's failure is raised typed, and a failed GPU-event host
task fails the step even though MLX's evaluation returned."""

from contextlib import contextmanager

from .engine import check_gpu_event_errors
from .errors import translate


@contextmanager
def rollback_on_error(cache, snap):
    """AFN-010: an evaluation that fails inside the block restores `cache` to `snap` (a step's
    failure leaves no half-applied state), and a streamed read's failure, which crosses MLX's
    evaluation boundary untyped, is raised as its typed stream error."""
    try:
        yield
        # A GPU-event host task that failed released the GPU over unwritten records: fail the step.
        check_gpu_event_errors()
    except BaseException as e:
        if snap is not None:
            cache.restore(snap)
        typed = translate(e)
        if typed is e:
            raise
        raise typed from e
