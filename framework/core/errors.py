"""Errors that the CLI turns into one line on stderr and a non-zero exit, and ``say``, which prints that line."""

import os
import sys


def say(line: str, out=None) -> None:
    """Print one line on ``out`` (default stderr) in a single write: ranks share their launcher's streams, and
    ``print`` writes text and newline apart, so two ranks' lines could merge. A stream keeping a log
    (``log_only``: rank 0's console) gets the line there too. Never raises for a console that is gone."""
    out = sys.stderr if out is None else out
    out = sys.stdout if out is None else out
    if out is None:
        return
    text = line + "\n"
    try:
        out.flush()   # (anything printed before stays before)
        fd = out.fileno()
    except (AttributeError, OSError, ValueError):   # a stream without a descriptor (a test's capture)
        fd = None
    try:
        if fd is None:
            out.write(text)   # (one call: a log it keeps gets the line too)
            out.flush()
            return
        data = text.encode(getattr(out, "encoding", None) or "utf-8", errors="replace")   # (as print would)
        while data:   # (one write unless the stream takes less)
            data = data[os.write(fd, data):]
    except (OSError, ValueError):   # the reader is gone (a closed pipe): the line has nowhere to go there
        pass
    if hasattr(out, "log_only"):
        out.log_only(text)


def first_line(error: BaseException) -> str:
    """The first line of ``error``'s message, or its type's name when the message is empty (a bare ``assert``)."""
    return next(iter(str(error).strip().splitlines()), type(error).__name__)


def typed_line(error: BaseException) -> str:
    """``Type: first line`` of ``error``, or only the type's name when its message is empty."""
    return f"{type(error).__name__}: {first_line(error)}" if str(error).strip() else type(error).__name__


def one_line(error: BaseException) -> str:
    """``error``'s whole message on one line (validators spread theirs over several), or its type's name when it
    has none."""
    return " ".join(str(error).split()) or type(error).__name__


class FrameworkError(Exception):
    """Base class for user-facing errors: the message says what is wrong and how to fix it. ``every_rank``: raised
    alike on every rank of the group (an outcome the ranks exchanged), so that all may go on to a sweep's next job."""

    every_rank = False


def on_every_rank(error: BaseException, every: bool = True) -> BaseException:
    """``error``, marked as raised on every rank (``every``) where it is a FrameworkError."""
    if every and isinstance(error, FrameworkError):
        error.every_rank = True
    return error


class ConfigError(FrameworkError, ValueError):
    """The configuration is invalid (unknown key, wrong type, incompatible choice). ``unknown_key``: the dotted
    key the message calls unknown (``config: unknown key 'KEY'``), where it is one."""

    def __init__(self, message: str, *, unknown_key: str | None = None):
        super().__init__(message)
        self.unknown_key = unknown_key


class DataError(FrameworkError):
    """Input data is missing or malformed."""


class TrainingError(FrameworkError):
    """Training cannot continue (for example the fp16 loss scale hit its minimum)."""


class DistributedError(FrameworkError):
    """A collective failed or timed out (a peer rank died or stalled). ``waited``: it timed out with no peer seen
    gone or stopped, where ranks that issued different collectives are as likely as a peer on another host."""

    def __init__(self, message: str, *, waited: bool = False):
        super().__init__(message)
        self.waited = waited


class SwapIOError(FrameworkError):
    """A swap file read or write failed (short count, EIO, ENOSPC, checksum): names the file, offset and tensor."""

    def __init__(self, message: str, *, path: str = "", offset: int = -1, what: str = "",
                 errno: int | None = None):
        super().__init__(message)
        self.path, self.offset, self.what, self.errno = path, offset, what, errno


class CheckpointError(FrameworkError):
    """A checkpoint is missing, incomplete, damaged or does not fit (the message names the file)."""


class UnsafePathError(FrameworkError):
    """A path the framework would create or write is a symbolic link (planted or left there)."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) while training: the CLI prints this one line, not a traceback."""

    def __init__(self, step: int):
        super().__init__(f"interrupted at step {step}")
        self.step = step


class Terminated(SystemExit):
    """SIGTERM while training (kill, a Slurm time limit): exit 128 + the signal's number, and the CLI prints ``line``;
    or another exit raised while training (``why``: what raises it), with its own status."""

    def __init__(self, step: int, code: int, why: str | None = None):
        super().__init__(code)
        self.line = f"terminated (SIGTERM) at step {step}" if why is None else f"stopped at step {step}: {why}"

    def __str__(self) -> str:
        return self.line
