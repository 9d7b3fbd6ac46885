"""Build-on-first-use of the C++ CPU optimizer kernels (csrc/cpu_optim), with a safe fallback.

``torch.utils.cpp_extension.load`` compiles into a cache folder keyed by torch, Python, sources and flags.
``BUILT`` marks a finished build, imported directly once the extension's recorded size and sha256 match (a
damaged file is rebuilt, never mapped). Builds are serialised with an ``flock`` the kernel drops if a builder
dies. A failed build leaves ``FAILED`` (keyed by ``CXX`` and ``PATH``): later runs with the same compiler fall
back at once with its reason; ``python -m framework.ops build`` retries.

The environment variables (ENVIRONMENT, also in ``python -m framework.ops --help`` and docs/stages.md).
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import os
import shutil
import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Iterator, NamedTuple

import torch

from framework.core.files import open_nofollow, write_atomic
from framework.core.paths import cache_dir, csrc_dir

NAME = "framework_cpu_optim"
SOURCES = ("cpu_optim/cpu_optim.cpp",)
HEADERS = ("include/framework_ops/simd.h", "include/framework_ops/optim_kernels.h")
# -ffp-contract=off: the kernels choose their fused multiply-adds (simd.h); -fvisibility=hidden: no PLT calls
# between kernels; -fopenmp, compiled but not linked: at::parallel_for's inline `omp parallel` binds to the
# OpenMP runtime torch loaded, so torch.set_num_threads applies.
CFLAGS = ("-O3", "-ffp-contract=off", "-fno-math-errno", "-fvisibility=hidden", "-fopenmp")
LOCK_TIMEOUT_S = 1800.0  # waiting for another process's build
ISAS = ("scalar", "avx2", "avx512")  # as the kernels name them, weakest first
PREFETCH_MAX = 2**31 - 1   # the kernels take an int
FALLBACK = ("adam/adamw run torch's fused kernel (with bias_correction=false their pure-PyTorch transforms), "
            "lion/adagrad/sgd their pure-PyTorch transforms")
ENVIRONMENT = """\
  FRAMEWORK_OPS=0           do not use the kernels at all (nothing is built or imported; on the host,
                            adam/adamw run torch's fused kernel, with bias_correction=false their
                            pure-PyTorch transforms, lion/adagrad/sgd their pure-PyTorch transforms)
  FRAMEWORK_OPS_BUILD=0     never compile; use a finished build if there is one, else fall back
  FRAMEWORK_OPS_CACHE=DIR   where builds go (default $XDG_CACHE_HOME/framework/ops, else
                            ~/.cache/framework/ops): set it where that is read-only or shared
  FRAMEWORK_OPS_VERBOSE=1   show the compiler's output
  FRAMEWORK_OPS_ISA=NAME    cap the instruction set: auto, scalar, avx2, avx512 (any case)
  FRAMEWORK_OPS_PREFETCH=N  software prefetch distance in floats (0: off; auto, the default: 256 on
                            Intel, off elsewhere); results do not depend on it
Switches take 1/0, true/false, yes/no, on/off (any case). python -m framework.train refuses a value these
do not allow (exit 2); elsewhere it makes the kernels unavailable, with the one fallback warning saying why
(python -m framework.ops shows it)."""
FLAGS = ("FRAMEWORK_OPS", "FRAMEWORK_OPS_BUILD", "FRAMEWORK_OPS_VERBOSE")


class BuildUnavailable(RuntimeError):
    """The kernels cannot be built or loaded here; the message says why."""


Status = NamedTuple("Status", [("module", ModuleType | None), ("reason", str | None)])   # reason: why module is None


def cache_root() -> Path:
    own = os.environ.get("FRAMEWORK_OPS_CACHE")
    try:
        return Path(own).expanduser() if own else cache_dir() / "ops"
    except RuntimeError:   # (pathlib's "Could not determine home directory.")
        raise BuildUnavailable(f"FRAMEWORK_OPS_CACHE={own!r} names the home of a user this machine does not know; "
                               "set it to a folder") from None


def build_dir() -> Path:
    """The folder for a build of the current sources with the current torch and Python."""
    root = csrc_dir()
    digest = hashlib.sha256()
    for rel in SOURCES + HEADERS:
        digest.update(rel.encode() + b"\0" + (root / rel).read_bytes() + b"\0")
    digest.update(" ".join(CFLAGS).encode())
    abi = f"torch-{torch.__version__}-py{sys.version_info.major}{sys.version_info.minor}"
    return cache_root() / abi / f"cpu_optim-{digest.hexdigest()[:12]}"


def _flag(var: str, default: bool) -> bool:
    """A switch's value; BuildUnavailable for one that is neither on nor off (a typo must not mean "on")."""
    value = os.environ.get(var, "").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    if not value:
        return default
    raise BuildUnavailable(f"{var}={os.environ[var]!r} is not one of 1/0, true/false, yes/no, on/off (any case); "
                           "fix or unset it")


def _on(var: str) -> bool:
    """A switch that defaults to on; a bad value counts as on here, and ``load`` refuses it with its reason."""
    try:
        return _flag(var, True)
    except BuildUnavailable:
        return True


def kernels_enabled() -> bool:
    return _on("FRAMEWORK_OPS")


def _cache_error(exc: OSError) -> BuildUnavailable:
    """A cache folder that cannot be made or written (read-only, a file in its place): one line saying how."""
    return BuildUnavailable(f"cannot write the kernel cache {exc.filename} ({exc.strerror}); set "
                            "FRAMEWORK_OPS_CACHE to a writable folder")


def _check_cache_root() -> None:
    """A file where the cache folder (or a folder above it) would be: one line, not "not built yet"."""
    root = cache_root()
    for path in (root, *root.parents):
        try:
            if not path.exists():
                continue
            folder = path.is_dir()
        except OSError:   # (one we may not look into: the mkdir or lock says what is wrong)
            return
        if not folder:
            where = "" if path == root else f" ({path} is a file)"
            raise BuildUnavailable(f"the kernel cache {root} is not a folder{where}; set FRAMEWORK_OPS_CACHE "
                                   "to a folder")
        return


def _compiler_key() -> str:
    """What a recorded failure holds for: the compiler as it resolves (with the build's tools on PATH)."""
    compiler = os.environ.get("CXX", "c++")
    key = "\0".join([compiler, str(shutil.which(compiler)), os.environ.get("PATH", "")])
    return hashlib.sha256(key.encode()).hexdigest()


def _import(directory: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(NAME, directory / f"{NAME}.so")   # an extension loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fingerprint(path: Path) -> str:
    """What BUILT records of the extension: its size and sha256."""
    data = path.read_bytes()
    return f"{len(data)} {hashlib.sha256(data).hexdigest()}"


def _finished(directory: Path) -> bool:
    """BUILT records the extension's size and sha256 and the file has them (a truncated one would SIGBUS)."""
    try:
        recorded = (directory / "BUILT").read_text().splitlines()
        return len(recorded) >= 2 and recorded[1] == _fingerprint(directory / f"{NAME}.so")
    except PermissionError as exc:   # another user's build, made under an owner-only umask (such as 077)
        raise BuildUnavailable(f"cannot read the build in {directory} ({exc.filename}: {exc.strerror}); have "
                               "the cache's owner run `python -m framework.ops build`, or set FRAMEWORK_OPS_CACHE "
                               "to a folder of yours") from None
    except OSError:
        return False


def _discard(directory: Path) -> None:
    """Remove a build's outputs and recorded failure: ninja would keep a damaged output newer than its inputs."""
    for name in ("BUILT", "FAILED", f"{NAME}.so", ".ninja_log", ".ninja_deps",
                 *(p.name for p in directory.glob("*.o"))):
        (directory / name).unlink(missing_ok=True)   # unlinked, not rewritten: a process that has it mapped keeps it


@contextmanager
def _tools_on_path() -> Iterator[None]:
    """The interpreter's bin folder (a venv's ninja) on PATH during the build; fail clearly without a compiler."""
    dirs = [os.path.dirname(sys.executable)]
    with contextlib.suppress(ImportError, AttributeError):
        import ninja  # the PyPI package ships the binary

        dirs.append(ninja.BIN_DIR)
    before = os.environ.get("PATH")
    path = (before or "").split(os.pathsep)
    os.environ["PATH"] = os.pathsep.join([d for d in dirs if d and d not in path] + path)
    try:
        compiler = os.environ.get("CXX", "c++")
        if shutil.which(compiler) is None:
            raise BuildUnavailable(f"no C++ compiler: {compiler!r} is not on PATH (set CXX)")
        if shutil.which("ninja") is None:
            raise BuildUnavailable("ninja is not on PATH (pip install ninja)")
        yield
    finally:
        if before is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = before


def _recorded_failure(directory: Path, key: str) -> None:
    """Raise BuildUnavailable with the reason of a failed build of these sources by this compiler."""
    try:
        recorded = (directory / "FAILED").read_text()
    except OSError:
        return
    found, _, reason = recorded.partition("\n")
    if found == key and reason.strip():
        raise BuildUnavailable(f"{reason.strip()} [recorded by an earlier build with this compiler; "
                               "`python -m framework.ops build` retries]")


@contextmanager
def _exclusive(directory: Path) -> Iterator[None]:
    """Hold the build lock of ``directory``: one builder at a time across processes."""
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _cache_error(exc) from None
    flock = directory.parent / f"{directory.name}.flock"
    try:
        handle = os.fdopen(open_nofollow(flock, os.O_RDWR | os.O_CREAT | os.O_APPEND, mode=0o666), "a+")
    except PermissionError as exc:   # e.g. a cache another user built, without a usable build of these sources
        raise BuildUnavailable(f"no usable build in {directory}, and this user cannot build there ({flock}: "
                               f"{exc.strerror}); have the cache's owner run `python -m framework.ops build`, "
                               "or set FRAMEWORK_OPS_CACHE to a folder of yours") from None
    except OSError as exc:   # a read-only file system, a full disk or quota
        raise _cache_error(exc) from None
    with handle:
        deadline, said = time.monotonic() + LOCK_TIMEOUT_S, False
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise BuildUnavailable(f"another process has been building in {directory} for "
                                           f"over {LOCK_TIMEOUT_S:.0f} s") from None
                if not said and _local_rank() == 0:   # once, from each machine's first rank
                    said = True
                    handle.seek(0)
                    holder = handle.read().strip() or "another process"
                    print(f"framework.ops: waiting for {holder} to finish building the C++ CPU optimizer kernels "
                          f"in {directory} (up to {LOCK_TIMEOUT_S:.0f} s)", file=sys.stderr, flush=True)
                time.sleep(0.2)
        with contextlib.suppress(OSError):   # who builds, for a process that waits (a read-only lock file: no one)
            handle.truncate(0)
            handle.write(f"pid {os.getpid()} on {socket.gethostname()}")
            handle.flush()
        try:
            yield
        finally:   # (not left to the close: a child forked meanwhile would hold the lock while it lives)
            fcntl.flock(handle, fcntl.LOCK_UN)


def _compile(directory: Path, force: bool = False, retry: bool = False) -> ModuleType:
    with _tools_on_path():
        key = _compiler_key()   # a recorded failure holds only for the same compiler
        if not force and not retry:
            _recorded_failure(directory, key)   # no lock needed to read it: written atomically
        with _exclusive(directory):
            from torch.utils import cpp_extension   # (not before a recorded failure: it imports setuptools)

            if not force:
                if _finished(directory):  # another process built it while we waited
                    with contextlib.suppress(ImportError):
                        return _import(directory)
                if not retry:
                    _recorded_failure(directory, key)   # or failed to
            try:
                directory.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise _cache_error(exc) from None
            _discard(directory)
            # torch's baton: stale, as nobody else builds here while we hold the flock
            (directory / "lock").unlink(missing_ok=True)
            root = csrc_dir()
            print(f"framework.ops: compiling the C++ CPU optimizer kernels (about a minute, once) into {directory}",
                  file=sys.stderr, flush=True)
            try:
                module = cpp_extension.load(
                    name=NAME, sources=[str(root / s) for s in SOURCES], extra_cflags=list(CFLAGS),
                    extra_include_paths=[str(root / "include")], build_directory=str(directory),
                    with_cuda=False, verbose=_flag("FRAMEWORK_OPS_VERBOSE", False))
            except Exception as exc:  # compiler errors arrive as RuntimeError with the full log
                log = directory / "build_error.log"
                lines = str(exc).splitlines() or [type(exc).__name__]
                first = next((line.strip() for line in lines if "error:" in line), lines[0])
                reason = f"the build failed ({first[:300]}); full log in {log}"
                try:
                    log.write_text(str(exc))
                    # Recorded: a slow failing compile per waiting rank would outlast the launch's timeout.
                    write_atomic(directory / "FAILED", f"{key}\n{reason}\n".encode(), shared=True)
                except OSError as write:   # (a full disk: the compiler's reason may be that too)
                    raise _cache_error(write) from exc
                raise BuildUnavailable(reason) from exc
            built = f"{torch.__version__}\n{_fingerprint(directory / f'{NAME}.so')}\n"
            write_atomic(directory / "BUILT", built.encode(), shared=True)
            return module


def check_environment(when_off: bool = True) -> tuple[str, int | None]:
    """BuildUnavailable for a value of ours the environment variables do not allow; else the ISA cap (lower
    case; "" or "auto": none) and the prefetch distance (None: auto). ``when_off=False``: with FRAMEWORK_OPS off
    only it is checked (a run that turned the kernels off to get past a problem reads none of the others)."""
    if not when_off and not _flag("FRAMEWORK_OPS", True):
        return "", None
    for var in FLAGS:
        _flag(var, True)
    isa = os.environ.get("FRAMEWORK_OPS_ISA", "").strip().lower()
    if isa not in ("", "auto") + ISAS:
        raise BuildUnavailable(f"FRAMEWORK_OPS_ISA={os.environ['FRAMEWORK_OPS_ISA']!r} is not one of auto, "
                               f"{', '.join(ISAS)} (any case); fix or unset it")
    prefetch = os.environ.get("FRAMEWORK_OPS_PREFETCH", "").strip().lower()
    number = prefetch.isascii() and prefetch.isdigit() and int(prefetch) <= PREFETCH_MAX
    if prefetch not in ("", "auto") and not number:
        raise BuildUnavailable(f"FRAMEWORK_OPS_PREFETCH={os.environ['FRAMEWORK_OPS_PREFETCH']!r} is not auto or a "
                               f"number of floats >= 0 (at most {PREFETCH_MAX}; 0: no software prefetch); fix or "
                               "unset it")
    return isa, int(prefetch) if number else None


def load(build: bool = True, force: bool = False, retry: bool = False) -> ModuleType:
    """The extension: a finished build imported, else (``build``) compiled; ``force``: compiled in any case;
    ``retry``: also over a recorded failure. Raises BuildUnavailable with the reason (a bad value of an
    environment variable too)."""
    isa, prefetch = check_environment()
    _check_cache_root()
    directory = build_dir()
    module = None
    if _finished(directory) and not force:
        try:
            module = _import(directory)
        except ImportError as exc:
            if not build:
                raise BuildUnavailable(f"cannot import the build in {directory}: {exc}") from exc
            # rebuilt from scratch below, under the lock
    if module is None:
        if not build:
            _not_built(directory)
        module = _compile(directory, force, retry)
    if isa in ISAS:   # a cap: never above what this CPU has
        module.set_isa(ISAS[min(ISAS.index(isa), ISAS.index(module.detected_isa()))])
    if prefetch is not None:
        module.set_prefetch(prefetch)
    return module


def _not_built(directory: Path) -> None:
    """Raise with why there is no build to import: damaged, a recorded failure, or none yet."""
    if not _flag("FRAMEWORK_OPS_BUILD", True):
        raise BuildUnavailable("not built yet and building is off (FRAMEWORK_OPS_BUILD=0); "
                               "run `python -m framework.ops build`")
    if (directory / "BUILT").exists():
        raise BuildUnavailable(f"the build in {directory} is damaged (its extension does not match BUILT); the "
                               "next build replaces it: run `python -m framework.ops build`")
    with _tools_on_path():   # (no compiler: says so)
        _recorded_failure(directory, _compiler_key())
    raise BuildUnavailable("not built yet (status never compiles: run `python -m framework.ops build`; "
                           "training builds it on first use)")


def _local_rank() -> int:
    """This process's rank on its machine where it is known without communicating (the launchers' LOCAL_RANK;
    else the global rank; else 0): each machine has its own cache and compiler."""
    value = os.environ.get("LOCAL_RANK", "")
    if value.isdigit():
        return int(value)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    value = os.environ.get("RANK", "0")
    return int(value) if value.isdigit() else 0


def attempt(build: bool) -> Status:
    """``load``, with a failure as its reason."""
    try:
        return Status(load(build=build), None)
    except Exception as exc:  # noqa: BLE001 - any failure means "fall back", never a crash
        return Status(None, str(exc) if isinstance(exc, BuildUnavailable) else f"{type(exc).__name__}: {exc}")


@functools.cache
def status() -> Status:
    """``load`` once per process (building unless FRAMEWORK_OPS_BUILD=0); never raises. Where it fails, ONE line
    on stderr says why (from each machine's first rank: its ranks share a cache, compiler and environment)."""

    found = attempt(build=_on("FRAMEWORK_OPS_BUILD"))
    if found.module is None and _local_rank() == 0:
        print(f"warning: framework.ops: C++ CPU optimizer kernels unavailable ({found.reason}); {FALLBACK}",
              file=sys.stderr, flush=True)
    return found
