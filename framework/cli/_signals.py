"""How a run ends on a signal: SIGTERM and Ctrl-C unwind the main thread, so the run closes what it opened.

A spawned rank also takes ``INTERRUPT``, the launcher's copy of a group's Ctrl-C. A signal Python would drop (raised
in a finalizer) or one landing inside Python's own lock code is sent again, soon, from another thread.
"""
from __future__ import annotations

import _thread
import concurrent.futures
import contextlib
import linecache
import os
import signal
import sys
import threading
import time
from typing import Iterator

from framework.comm.distributed import process_state
from framework.core.errors import Interrupted, Terminated

INTERRUPT = signal.SIGUSR1   # the launcher's Ctrl-C passed on to a rank: Ctrl-C unless it is interrupted already

@contextlib.contextmanager
def signals_unwind(rank: bool = False) -> Iterator[None]:
    """SIGTERM raises SystemExit(143) in the main thread (later ones ignored), as Ctrl-C raises KeyboardInterrupt.
    A ``rank`` ignores SIGINT and ``INTERRUPT`` afterwards (it is ending). Leaving waits for the re-sends (of a
    signal whose exception a finalizer dropped, or that landed in ``_taking_a_lock``'s code): under the previous
    handlers SIGTERM would end the process uncleaned."""
    if threading.current_thread() is not threading.main_thread():   # (library use: only there may it be set)
        yield
        return
    stopping: list[int] = []   # the SIGTERM being acted on
    interrupting: list[bool] = []   # non-empty once interrupted (a rank's launcher's copy then ignored)
    hooked = threading.Event()   # set while a dropped exception is being handled: no raising there
    resent: list[threading.Event] = []   # per signal sent again, set once it is sent
    deferred: list[int] = [0]   # the signal's re-sends from lock code in a row (bounded: a lock never freed)

    def again(signum: int) -> None:   # (threading.Thread.start would wait, in the callback, for it to run)
        sent = threading.Event()
        resent.append(sent)

        def soon(thread: int) -> None:
            try:
                time.sleep(0.001)   # let the main thread leave the callback first
                signal.pthread_kill(thread, signum)
            finally:
                sent.set()
        _thread.start_new_thread(soon, (threading.main_thread().ident,))

    def handle(signum, frame):
        if hooked.is_set():
            return again(signum)
        if _taking_a_lock(frame) and deferred[0] < _LOCK_RESENDS:
            deferred[0] += 1
            return again(signum)
        deferred[0] = 0
        if signum == signal.SIGTERM:
            if not stopping:
                stopping.append(signum)
                raise SystemExit(128 + signum)
        elif signum != INTERRUPT or not interrupting:   # (else the launcher's copy of the Ctrl-C being acted on)
            interrupting[:] = [True]
            raise KeyboardInterrupt

    def dropped(info):
        hooked.set()
        try:
            if info.exc_type is KeyboardInterrupt:
                again(signal.SIGINT)   # (a SIGINT always raises)
            elif info.exc_type is SystemExit and stopping:
                again(stopping.pop())
            else:
                hook(info)
        finally:
            hooked.clear()

    previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, handle)}
    if rank:
        previous[INTERRUPT] = signal.signal(INTERRUPT, handle)
    if rank or signal.getsignal(signal.SIGINT) is signal.default_int_handler:   # (not where it is ignored)
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, handle)
    hook, sys.unraisablehook = sys.unraisablehook, dropped
    try:
        yield
    finally:
        # Wait (1 s at most each) for every re-send: its handler runs here; the first exception is raised once all are.
        raised = None
        try:
            for sent in resent:
                while True:
                    try:
                        sent.wait(1.0)
                        break
                    except BaseException as e:   # a handler's, raised inside the wait
                        raised = raised or e
            if raised is not None:
                raise raised
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, signal.SIG_IGN if rank and signum != signal.SIGTERM else handler)
            sys.unraisablehook = hook


# Python's own lock code, where an exception can fall between taking a lock and entering the block that gives it
# back (a Condition's ``with``, a futures wait over several futures): raised there, the lock stays held for good, a
# thread that needs it then never returns, and an unwinding that waits for that thread (the host step's) hangs.
_LOCK_CODE = frozenset(f.__code__.co_filename for f in (threading.Condition.wait, concurrent.futures.Future.result))
# A main thread blocked for good taking a lock another thread holds still takes Ctrl-C, after this many re-sends
# (a second or so): a deadlock must stay breakable, and a signal landing in the window is re-sent once or twice.
_LOCK_RESENDS = 500
_WAIT = threading.Condition.wait.__code__   # where it blocks it gives the lock back on any exception
# A join gives nothing back either. Python 3.13 blocks in ``Thread.join`` itself (``_wait_for_tstate_lock`` is gone),
# older ones in that helper; both are listed so that a signal during a join is acted on at once on every version.
_JOINS = frozenset(code for code in (threading.Thread.join.__code__, getattr(
    getattr(threading.Thread, "_wait_for_tstate_lock", None), "__code__", None)) if code is not None)


def _taking_a_lock(frame) -> bool:
    """Whether raising in ``frame`` might leave a lock held (not a wait blocked in a Condition or a join)."""
    code = frame.f_code if frame is not None else None
    if code is None or code.co_filename not in _LOCK_CODE or code in _JOINS:
        return False
    if code is not _WAIT:
        return True
    # Without the stdlib's sources (a .pyc-only install) the line is "": a signal is then acted on rather than
    # deferred for a second or so, as most signals landing in a Condition's wait land where it blocks.
    line = linecache.getline(code.co_filename, frame.f_lineno)
    return bool(line) and "waiter.acquire(" not in line


def terminated_line(e: SystemExit) -> str | None:
    """The one line for a run a SIGTERM ended (``signals_unwind``'s SystemExit), None for any other exit."""
    sigterm = "terminated (SIGTERM)" if e.code == 128 + signal.SIGTERM else None
    return e.line if isinstance(e, Terminated) else sigterm


def interrupted_line(rank: int, e: KeyboardInterrupt, launcher: int) -> str:
    """A spawned rank's line for its Ctrl-C: the group's (passed on by the launcher), or ``_die_with``'s once its
    ``launcher`` is gone (killed with -9: nobody pressed Ctrl-C). Such a launcher sends torch's pdeathsig (SIGINT)
    as its main thread exits, while the rank is still its child: its state is then "gone" (PF_EXITING, a zombie)."""
    if os.getppid() == launcher and process_state(launcher) != "gone":
        return f"rank {rank}: {str(e) or 'interrupted'}"
    at = f" at step {e.step}" if isinstance(e, Interrupted) else ""
    return f"rank {rank}: stopped{at}: its launcher (pid {launcher}) is gone (killed?)"
