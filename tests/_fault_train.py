"""The training command with the fault tests' hook, for runs that torchrun starts and that cannot
be handed a callback (tests/dist/test_checkpoint_faults.py):

    python -m torch.distributed.run --nproc-per-node 2 -m tests._fault_train <framework.train's arguments>

``FRAMEWORK_FAULT=<point>@<rank>[,stop|,raise|,fail][,once=<marker file>]`` ends rank ``rank`` with
``os._exit(17)`` (as a kill would, no cleanup) when it reaches ``point`` (``step:<N>``: after train
step N; ``save-<N>:<point>``: a point of the save of step N); with ``stop`` it sends itself SIGSTOP
instead (a stalled rank), with ``raise`` it raises a RuntimeError (a bug, the allocator's error), with
``fail`` a FrameworkError and it is slow to exit (as W&B's teardown is). With ``once`` it fires only if the
marker file does not exist yet, and creates it. In-process tests call ``fault`` themselves.
"""
import atexit
import os
import signal
import sys
import time


def fault(point: str, rank: int) -> None:
    spec = os.environ.get("FRAMEWORK_FAULT")
    if not spec:
        return
    where, _, once = spec.partition(",once=")
    where, raises = where.removesuffix(",raise"), where.endswith(",raise")
    where, stop = where.removesuffix(",stop"), where.endswith(",stop")
    where, fails = where.removesuffix(",fail"), where.endswith(",fail")
    if where != f"{point}@{rank}":
        return
    if once:
        try:
            os.close(os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        except FileExistsError:
            return
    if fails:
        from framework.core.errors import FrameworkError

        atexit.register(time.sleep, 1.5)   # (its peer exits at once: well inside the launcher's 5 s, even loaded)
        raise FrameworkError(f"FRAMEWORK_FAULT: rank {rank} fails at {point}")
    if raises:
        raise RuntimeError(f"FRAMEWORK_FAULT: rank {rank} raises at {point}")
    print(f"FRAMEWORK_FAULT: rank {rank} {'stops' if stop else 'exits'} at {point}", file=sys.stderr, flush=True)
    if stop:
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    os._exit(17)


def on_point(point: str) -> None:
    """``fault`` for this process's rank (torchrun and the spawned ranks set RANK)."""
    fault(point, int(os.environ.get("RANK", "0")))


if __name__ == "__main__":
    from framework.cli.train import main

    main(on_point=on_point)
