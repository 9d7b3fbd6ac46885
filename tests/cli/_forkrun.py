"""A fork server for the README test: imports the framework's command-line modules once, then runs
each ``python -m framework.X ARGS`` command in a forked child, so a command costs its own work and
not the seconds of importing torch and Hydra again.

    python -m tests.cli._forkrun      # reads one JSON request per line on stdin, answers on stdout

Request: {"module": "framework.train", "args": [...], "cwd": DIR, "env": {...}, "out": FILE, "err": FILE,
"timeout": S}; answer: {"rc": N} (124 when the child ran past its timeout and was killed). With "started":
true the child's pid comes first, {"pid": N}, for a test that signals the command while it runs (the child
leads its own process group, and takes SIGINT as Python started from a terminal does). Torch
starts no threads at import, so the children start from a single-threaded parent; ranks a command
spawns are fresh interpreters, as always.
"""
from __future__ import annotations

import faulthandler
import json
import os
import runpy
import signal
import sys
import threading
import warnings


def _child(req: dict) -> None:
    os.chdir(req["cwd"])
    os.environ.update(req["env"])
    for fd, path in ((1, req["out"]), (2, req["err"])):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    faulthandler.enable()   # a crash, or a test's SIGABRT to a hung command: every thread's stack in its stderr
    if req.get("started"):   # (a server started in the background inherited SIGINT ignored)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.argv = [req["module"], *req["args"]]
    # The module was imported here already (that is the point); runpy runs it afresh as __main__.
    warnings.filterwarnings("ignore", message=".*found in sys.modules after import of package", category=RuntimeWarning)
    code = 0
    try:
        runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - the traceback goes to the command's stderr
        import traceback
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _wait(pid: int, timeout: float) -> int:
    timer = threading.Timer(timeout, os.killpg, (pid, signal.SIGKILL))   # its spawned ranks too
    timer.start()
    try:
        _, status = os.waitpid(pid, 0)
    finally:
        timer.cancel()
        timer.join()   # (gone before the next fork: a fork with a thread alive warns on 3.12, and may deadlock)
    code = os.waitstatus_to_exitcode(status)
    return 124 if code == -signal.SIGKILL else code


def _lazy_imports(req: dict) -> list[str]:
    """Modules a command imports on first use that cost a second of CPU or more each time: imported once
    here, before the first child that needs them, rather than in every such child. The memory
    estimator's meta-device trace (framework.estimate, framework.plan) pulls in torch._dynamo and
    sympy (about 1 s); a W&B run's start imports wandb and its launch package (about 1 s). Only where
    a command needs them: a server that never runs one pays nothing."""
    mods = []
    if req["module"] in ("framework.estimate", "framework.plan"):
        mods.append("torch._dynamo")
    if any(a.startswith("logger=wandb") for a in req["args"]):
        mods += ["wandb", "wandb.sdk.launch"]
    return [m for m in mods if m not in sys.modules]


def main() -> None:
    import framework.estimate  # noqa: F401  (what the commands import: paid once, here)
    import framework.plan  # noqa: F401
    import framework.recipe  # noqa: F401
    import framework.report  # noqa: F401
    import framework.train  # noqa: F401
    import framework.export  # noqa: F401  (as above)
    import gc
    gc.collect()
    gc.freeze()   # the imports' objects: the children's full collections skip them (tests/conftest.py, _one_thread)

    for line in sys.stdin:
        req = json.loads(line)
        lazy = _lazy_imports(req)
        if lazy:
            import contextlib
            import importlib
            for m in lazy:
                with contextlib.suppress(ImportError):   # (the command then says so itself)
                    importlib.import_module(m)
            gc.collect()
            gc.freeze()
        pid = os.fork()
        if pid == 0:
            os.setpgid(0, 0)   # its spawned ranks go with it on a timeout
            _child(req)
        if req.get("started"):
            print(json.dumps({"pid": pid}), flush=True)
        print(json.dumps({"rc": _wait(pid, req["timeout"])}), flush=True)


if __name__ == "__main__":
    main()


class ForkRunner:
    """The test side: one server process; ``run`` behaves like ``subprocess.run([python, -m,
    module, *args], capture_output=True, text=True)`` (returncode, stdout, stderr)."""

    def __init__(self, root: str):
        import subprocess
        import tempfile

        self._dir = tempfile.mkdtemp(prefix="framework-forkrun-")
        self._n = 0
        self._started: Started | None = None
        env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self._p = subprocess.Popen([sys.executable, "-m", "tests.cli._forkrun"], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True, env=env, cwd=root)

    def run(self, module: str, args: list[str], *, cwd, env: dict | None = None, timeout: float = 240):
        import subprocess

        self._n += 1
        out, err = os.path.join(self._dir, f"{self._n}.out"), os.path.join(self._dir, f"{self._n}.err")
        rc = self._request(module, args, cwd, env, out, err, timeout, started=False)["rc"]
        with open(out) as o, open(err) as e:
            return subprocess.CompletedProcess([module, *args], rc, o.read(), e.read())

    def start(self, module: str, args: list[str], *, cwd, out, err, env: dict | None = None,
              timeout: float = 300) -> "Started":
        """The command started, as ``subprocess.Popen`` with ``start_new_session`` (stdout, stderr into the
        files ``out``, ``err``): its pid to signal; the next request first waits for it."""
        return Started(self, self._request(module, args, cwd, env, str(out), str(err), timeout, started=True)["pid"])

    def _request(self, module, args, cwd, env, out, err, timeout, started: bool) -> dict:
        if self._started is not None:   # (its answer comes before the next one)
            self._started.wait()
        self._p.stdin.write(json.dumps({"module": module, "args": list(args), "cwd": str(cwd), "env": env or {},
                                        "out": out, "err": err, "timeout": timeout, "started": started}) + "\n")
        self._p.stdin.flush()
        return self._answer()

    def _answer(self) -> dict:
        answer = self._p.stdout.readline()
        if not answer:
            raise RuntimeError("the fork server died")
        return json.loads(answer)

    def close(self) -> None:
        import shutil

        self._p.stdin.close()
        self._p.wait(timeout=60)
        shutil.rmtree(self._dir, ignore_errors=True)


class Started:
    """A command ``ForkRunner.start`` started: ``pid`` (its process group's too), ``poll`` and ``wait`` as Popen's."""

    def __init__(self, runner: ForkRunner, pid: int):
        self.runner, self.pid, self.returncode = runner, pid, None
        runner._started = self

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                os.kill(self.pid, 0)   # (the server reaps it as it ends)
            except ProcessLookupError:
                return self.wait()
        return self.returncode

    def wait(self) -> int:
        """Its exit status (124: killed at the start's timeout)."""
        if self.returncode is None:
            self.runner._started = None
            self.returncode = self.runner._answer()["rc"]
        return self.returncode
