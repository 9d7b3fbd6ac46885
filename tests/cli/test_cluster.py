"""Scale-out as users run it, without a cluster: Hydra's submitit launcher config (recipes/cluster)
composes and generates the sbatch script Slurm would receive; the plain sbatch + torchrun script
builds a valid torchrun command line; Slurm task ids map to torchrun's rank variables."""
from __future__ import annotations

import contextlib
import importlib.util
import os
import shlex
import subprocess
from pathlib import Path

import pytest

from framework import compose
from framework.cli.launch import error_line, signals_unwind, slurm_task_env
from framework.core.paths import conf_dir

CLUSTER = Path(__file__).resolve().parents[2] / "recipes" / "cluster"


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:   # its parent package is missing
        return False


needs_submitit = pytest.mark.skipif(
    not (_installed("hydra_plugins.hydra_submitit_launcher") and _installed("submitit")),
    reason="Hydra's submitit launcher is not installed (pip install -e '.[slurm]')")


_WITHOUT_LAUNCHER = r'''
import sys
class Hiding:   # Hydra's plugins (the submitit launcher) as not installed
    def __init__(self, finder):
        self.finder = finder
    def find_spec(self, name, path=None, target=None):
        find = getattr(self.finder, "find_spec", None)
        return None if name.split(".")[0] == "hydra_plugins" or find is None else find(name, path, target)
    def __getattr__(self, name):
        return getattr(self.finder, name)
sys.meta_path[:] = [Hiding(f) for f in sys.meta_path]
import framework
try:
    framework.compose(["hydra/launcher=submitit_slurm"])
except framework.ConfigError as e:
    print(e)
'''


def test_the_submitit_launcher_not_installed_names_the_extra():
    """Hydra lists the launchers it has and its search path; the line names the extra to install instead."""
    import sys

    p = subprocess.run([sys.executable, "-c", _WITHOUT_LAUNCHER], capture_output=True, text=True, timeout=120)
    assert p.stdout.strip() == ("config: hydra/launcher=submitit_slurm needs Hydra's submitit launcher, which is not "
                                "installed: pip install -e '.[slurm]'"), p.stdout + p.stderr[-2000:]


def _stub(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)


@needs_submitit
def test_submitit_launcher_config_and_its_sbatch_script(tmp_path, monkeypatch):
    import submitit
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
    from omegaconf import OmegaConf

    overrides = ["+stage=zero3", "offload=cpu", "hydra.launcher.nodes=4", "hydra.launcher.partition=gpu"]
    cfg = compose(overrides, config_dir=str(CLUSTER), config_name="config")   # the schemas accept the job
    assert (cfg.choices["stage"], cfg.choices["model"], cfg.dist.backend) == ("zero3", "gpt2-small", "nccl")
    assert cfg.checkpoint.every == 500   # (a requeued job resumes only from a periodic save)
    with initialize_config_dir(config_dir=str(CLUSTER), version_base="1.3"):
        full = hydra_compose("config", overrides=[*overrides, f"hydra.searchpath=[file://{conf_dir()}]"],
                             return_hydra_config=True)
    launcher = OmegaConf.to_container(full.hydra.launcher, resolve=False)
    assert launcher["_target_"].endswith("submitit_launcher.SlurmLauncher")
    # What the plugin hands to submitit (its launch(): base keys as they are, the rest slurm_-prefixed),
    # and the sbatch file submitit would submit. submitit looks for srun before it builds anything.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _stub(bin_dir, "srun", 'exec "$@"')
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    executor = submitit.AutoExecutor(cluster="slurm", folder=str(tmp_path / "submitit"))
    base = set(OmegaConf.structured(BaseQueueConf).keys())
    executor.update_parameters(**{(k if k in base else f"slurm_{k}"): v for k, v in launcher.items()
                                  if k not in ("submitit_folder", "max_num_timeout", "_target_")})
    text = executor._executor._make_submission_file_text("python -u -m submitit.core._submit FOLDER", "uid")
    for line in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --partition=gpu", "#SBATCH --time=240", "export SUBMITIT_EXECUTOR=slurm"):
        assert line in text, text
    assert "srun " in text and "submitit.core._submit" in text


def test_sbatch_torchrun_script_command_line(tmp_path):
    """Run the sbatch script with stand-ins for scontrol, srun and torchrun: the torchrun command
    line it builds rendezvouses on the first node and its overrides compose."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "torchrun.args"
    _stub(bin_dir, "scontrol", 'printf "gpu03\\ngpu04\\n"')
    _stub(bin_dir, "srun", 'exec "$@"')
    _stub(bin_dir, "torchrun", f'for a in "$@"; do printf "%s\\n" "$a"; done > {shlex.quote(str(record))}')
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_NODELIST": "gpu[03-04]",
           "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_ID": "4242"}
    p = subprocess.run(["bash", str(CLUSTER / "sbatch_torchrun.sh"), "+stage=zero3", "offload=cpu"],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert p.returncode == 0, p.stderr
    args = record.read_text().splitlines()
    flags = dict(zip(args[0:10:2], args[1:10:2]))
    assert flags == {"--nnodes": "2", "--nproc-per-node": "8", "--rdzv-id": "4242", "--rdzv-backend": "c10d",
                     "--rdzv-endpoint": "gpu03:24242"}   # a port of the job's own: 20000 + 4242 % 40000
    assert args[10:12] == ["-m", "framework.train"]
    overrides = args[12:]
    assert "hydra.run.dir=outputs/slurm-4242" in overrides and overrides[-2:] == ["+stage=zero3", "offload=cpu"]
    cfg = compose([o for o in overrides if not o.startswith("hydra.")])
    assert (cfg.choices["stage"], cfg.choices["offload"], cfg.dist.backend, cfg.checkpoint.every) == (
        "zero3", "cpu", "nccl", 500)
    env.update(SLURM_JOB_ID="123456", MASTER_PORT="")   # another job on the same head node: another port
    p = subprocess.run(["bash", str(CLUSTER / "sbatch_torchrun.sh")], capture_output=True, text=True, env=env,
                       cwd=tmp_path, timeout=60)
    assert p.returncode == 0 and "gpu03:23456" in record.read_text().splitlines(), p.stderr
    env["MASTER_PORT"] = "29611"
    subprocess.run(["bash", str(CLUSTER / "sbatch_torchrun.sh")], check=True, env=env, cwd=tmp_path, timeout=60)
    assert "gpu03:29611" in record.read_text().splitlines()


def test_slurm_tasks_map_to_rank_variables(monkeypatch):
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SUBMITIT_EXECUTOR"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("SLURM_NTASKS", "16")
    assert slurm_task_env() == {}                 # srun without submitit: not ours to map
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
    monkeypatch.setenv("WORLD_SIZE", "16")
    assert slurm_task_env() == {}                 # torchrun (or another launcher) already did
    monkeypatch.delenv("WORLD_SIZE")
    if not _installed("submitit"):
        pytest.skip("submitit is not installed (pip install -e '.[slurm]')")
    for key, value in {"SLURM_PROCID": "9", "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_JOB_NUM_NODES": "2",
                       "SLURM_JOB_NODELIST": "gpu[03-04]", "SLURM_JOB_ID": "4242", "MASTER_PORT": "29611"}.items():
        monkeypatch.setenv(key, value)
    assert slurm_task_env() == {"RANK": "9", "LOCAL_RANK": "1", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8",
                                "MASTER_ADDR": "gpu03", "MASTER_PORT": "29611"}
    # Nodes with unequal task counts (10 tasks on 4 nodes): each node's own count, as Slurm lists it
    from framework.comm.distributed import check_env_ints

    for procid, localid, node, here in (("2", "2", "0", "3"), ("9", "1", "3", "2")):
        for key, value in {"SLURM_NTASKS": "10", "SLURM_JOB_NUM_NODES": "4", "SLURM_JOB_NODELIST": "gpu[01-04]",
                           "SLURM_TASKS_PER_NODE": "3(x2),2(x2)", "SLURM_PROCID": procid, "SLURM_LOCALID": localid,
                           "SLURM_NODEID": node}.items():
            monkeypatch.setenv(key, value)
        env = slurm_task_env()
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == (procid, localid, "10", here)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        check_env_ints()
        for key in env:
            monkeypatch.delenv(key)
    # The local executor's tasks (hydra/launcher=submitit_local hydra.launcher.tasks_per_node=2), on this host:
    # each trained alone into one run folder before (the leftover Slurm variables above are not its own)
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "local")
    for key, value in {"SUBMITIT_LOCAL_NTASKS": "2", "SUBMITIT_LOCAL_LOCALID": "1", "SUBMITIT_LOCAL_GLOBALID": "1",
                       "SUBMITIT_LOCAL_NODEID": "0", "SUBMITIT_LOCAL_JOB_NUM_NODES": "1",
                       "SUBMITIT_LOCAL_JOB_ID": "4242", "MASTER_PORT": "29611"}.items():
        monkeypatch.setenv(key, value)
    assert slurm_task_env() == {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29611"}
    # ... of which task 0 alone rewrites the sweep's multirun.yaml (read before launch sets RANK), as torchrun's rank 0
    from framework.cli._hydra import first_rank

    assert not first_rank()
    monkeypatch.setenv("SUBMITIT_LOCAL_GLOBALID", "0")
    monkeypatch.setenv("SUBMITIT_LOCAL_LOCALID", "0")
    assert first_rank()
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert not first_rank()
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setenv("SUBMITIT_LOCAL_GLOBALID", "1")
    monkeypatch.setenv("SUBMITIT_LOCAL_LOCALID", "1")
    # ... over whose ranks a DeepSpeed file's batch is divided, as over Slurm's
    import functools

    from framework.cli import train
    from framework.config import standalone_composer

    composer = functools.partial(standalone_composer, config_dir=None, config_name="train")
    assert [train._sweep_world([f"hydra/launcher=submitit_{where}", "hydra.launcher.tasks_per_node=2"],
                               "hydra.sweep.dir", composer) for where in ("local", "slurm")] == [2, 2]


@pytest.mark.parametrize("env,says", [
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 is set but RANK, MASTER_ADDR, MASTER_PORT are not"),
    ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "NPROC": "4"},
     "dist.nproc=4 differs from WORLD_SIZE=2"),
    ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},   # (set: dist.nproc=1)
     "dist.nproc=1 differs from WORLD_SIZE=2"),
    # torchrun's one worker (--nproc-per-node 1) would spawn the ranks itself
    ({"WORLD_SIZE": "1", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "r",
      "NPROC": "2"}, "dist.nproc=2 differs from WORLD_SIZE=1 set by the launcher (torchrun)"),
    ({"SLURM_NTASKS": "4", "SLURM_STEP_ID": "0"}, "SLURM_NTASKS=4"),
    ({"SLURM_NTASKS": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_ID": "0"}, "SLURM_STEP_NUM_TASKS=2"),
    ({"WORLD_SIZE": "2x"}, "WORLD_SIZE='2x' is not an integer; unset it or launch with torchrun"),
    ({"SLURM_NTASKS": "two", "SLURM_STEP_ID": "0"}, "SLURM_NTASKS='two' is not an integer; unset it or launch with srun"),
    # rank variables that disagree: one line, not a wait at the rendezvous that ends in torch's traceback
    ({"WORLD_SIZE": "2", "RANK": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
     "RANK=2 is not a rank of WORLD_SIZE=2 (0 to 1)"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0: a launch has at least 1 rank"),
    ({"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "LOCAL_RANK": "2",
      "LOCAL_WORLD_SIZE": "2"}, "LOCAL_RANK=2 is not a rank of LOCAL_WORLD_SIZE=2"),
    ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "SLURM_PROCID": "1",
      "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_ID": "0"}, "RANK=0 but SLURM_PROCID=1 in a step of 2 tasks: RANK must "
                                                          "be set per task"),
])
def test_a_launch_environment_that_cannot_work_is_one_line(monkeypatch, tmp_path, env, says):
    """A leftover WORLD_SIZE, dist.nproc under torchrun, or srun without torchrun/submitit: one line
    before anything connects or spawns."""
    from framework.cli.launch import launch
    from framework.core.errors import ConfigError
    from framework.loggers import RunInfo

    for key in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_NTASKS", "SLURM_STEP_ID",
                "SLURM_STEP_NUM_TASKS", "SUBMITIT_EXECUTOR", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID",
                "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(key, raising=False)
    nproc = env.pop("NPROC", "1")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    cfg = compose(["train.steps=1", f"dist.nproc={nproc}", "logger=none"])
    with pytest.raises(ConfigError) as e:
        launch(cfg, RunInfo(tmp_path / "run", None, None))
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_rank_variables_that_agree_pass(monkeypatch):
    """torchrun under srun numbers its ranks itself (RANK need not be SLURM_PROCID); a leftover RANK=0 alone is
    rank 0 of 1; srun tasks that each have their own RANK pass."""
    from framework.comm.distributed import check_env_ints

    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_NTASKS", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "3")   # alone: a GPU's index, with no local world to be out of
    check_env_ints()
    for key, value in {"WORLD_SIZE": "2", "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "LOCAL_RANK": "0",
                       "LOCAL_WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": "4242"}.items():
        monkeypatch.setenv(key, value)
    check_env_ints()
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    monkeypatch.setenv("RANK", "1")
    check_env_ints()


def test_a_torchrun_restart_count_that_is_not_an_integer_is_one_line(monkeypatch):
    """It names the attempt's own store prefix: read as 0 it would share the first attempt's keys."""
    from framework.comm.distributed import check_env_ints
    from framework.comm.rendezvous import env_restarts
    from framework.core.errors import ConfigError

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "one")
    for check in (check_env_ints, env_restarts):
        with pytest.raises(ConfigError, match="^TORCHELASTIC_RESTART_COUNT='one' is not an integer; unset it or "
                                              "launch with torchrun$"):
            check()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert env_restarts() == 2


def test_local_ranks_started_inside_a_slurm_batch_step_pass(monkeypatch):
    """dist.nproc=2 in an sbatch --ntasks=2 script: the launcher numbers its ranks itself and each inherits the
    batch step's SLURM_PROCID=0, which is no per-task RANK to compare with (rank_env drops it)."""
    from framework.cli.launch import rank_env
    from framework.comm.distributed import check_env

    for key in ("SLURM_STEP_NUM_TASKS", "SLURM_STEP_ID", "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    for key, value in {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
                       "LOCAL_WORLD_SIZE": "2", "RANK": "1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")   # (monkeypatch puts each back as it was after the test)
    rank_env(1, 2)
    check_env(store_path="rendezvous-file")


def test_local_ranks_inside_a_slurm_batch_step_choose_one_backend(monkeypatch):
    """dist.nproc=2 with one GPU in an sbatch --ntasks=2 script: every rank resolves the same backend (gloo with
    its note), not rank 0 alone NCCL as if it were a Slurm task bound to a GPU of its own."""
    from framework.cli.launch import rank_env
    from framework.comm import distributed

    monkeypatch.setattr(distributed, "gpu_count", lambda: 1)
    chosen = []
    for rank in (0, 1):
        for key, value in {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2",
                           "CUDA_VISIBLE_DEVICES": "0"}.items():
            monkeypatch.setenv(key, value)
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GLOO_SOCKET_IFNAME"):
            monkeypatch.setenv(key, "x")   # (monkeypatch puts each back as it was after the test)
        rank_env(rank, 2)
        chosen.append(distributed.resolve_backend("auto", 2))
    assert chosen == ["gloo", "gloo"], chosen


def test_a_torchrun_restart_with_nothing_to_resume_says_why(monkeypatch, tmp_path, capfd):
    """A restart (TORCHELASTIC_RESTART_COUNT > 0) composes a new ${now} run folder: it names the fixed folder
    that would resume it instead of silently starting from step 0."""
    from framework.cli.launch import launch
    from framework.loggers import RunInfo

    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_NTASKS", "SLURM_STEP_ID"):
        monkeypatch.delenv(key, raising=False)
    cfg = compose(["train.steps=1", "logger=none", "checkpoint.every=1"])
    launch(cfg, RunInfo(tmp_path / "run", None, None))   # attempt 0: its own folder
    assert "torchrun restart" not in capfd.readouterr().err
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    launch(cfg, RunInfo(tmp_path / "run1", None, None))   # attempt 1: a new ${now} folder
    err = capfd.readouterr().err
    assert f"torchrun restart 1: no checkpoint in {tmp_path / 'run1'}" in err and "hydra.run.dir" in err, err
    launch(cfg, RunInfo(tmp_path / "run", None, None))   # a fixed folder: resumed, nothing said
    assert "torchrun restart" not in capfd.readouterr().err


def test_one_process_in_an_interactive_slurm_step_runs(monkeypatch):
    """salloc's interactive step keeps the allocation's SLURM_NTASKS; the step itself has one task."""
    from framework.cli.launch import check_launch_env

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for key, value in {"SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "1", "SLURM_STEP_ID": "0"}.items():
        monkeypatch.setenv(key, value)
    check_launch_env(compose(["train.steps=1"]))


@pytest.mark.parametrize("sig, raised", [("SIGINT", KeyboardInterrupt), ("SIGTERM", SystemExit)])
def test_a_signal_landing_in_a_finalizer_still_stops_the_run(sig, raised, capfd):
    """Python drops (and prints with a traceback) an exception raised inside a weakref callback: a Ctrl-C or
    SIGTERM arriving while one runs (the checking accelerator runs one per freed storage) would be lost."""
    import signal
    import time
    import weakref

    class Box:
        pass

    def finalizer():
        signal.raise_signal(getattr(signal, sig))
        for _ in range(1000):   # the handler runs here, inside the callback
            pass

    # as an interactive shell starts Python (a background job starts with SIGINT ignored, which the block keeps)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(raised):
            with signals_unwind():
                box = Box()
                weakref.finalize(box, finalizer)
                del box
                time.sleep(5)   # a lost signal: nothing ends the sleep early
        assert "Traceback" not in capfd.readouterr().err
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, before)


def test_a_signal_sent_again_lands_before_the_previous_handlers_come_back():
    """A SIGTERM whose SystemExit a finalizer dropped is sent again from another thread: a block left before
    it lands waits for it, and raises its SystemExit, never letting it reach the handler from before
    (SIGTERM's default would end the process without any cleanup)."""
    import signal
    import sys
    import time
    from types import SimpleNamespace

    before = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: before.append(signum))
    code = None
    try:
        with signals_unwind():
            with pytest.raises(SystemExit):
                signal.raise_signal(signal.SIGTERM)
            # that SystemExit, as if dropped inside a finalizer: sent again, and the block left at once
            sys.unraisablehook(SimpleNamespace(exc_type=SystemExit, exc_value=SystemExit(143),
                                               exc_traceback=None, err_msg=None, object=None))
    except SystemExit as e:
        code = e.code
    finally:
        time.sleep(0.1)   # (where it was not waited for: its landing, here under the handler from before)
        signal.signal(signal.SIGTERM, previous)
    assert code == 143 and before == [], (code, before)


def test_a_signal_never_leaves_a_lock_held():
    """A Ctrl-C landing where Python's ``with`` on a Condition has taken the lock but not yet entered the block
    that gives it back would leave the lock held for good: the host step's worker then waits on it forever, and
    so does the run's unwinding, which waits for the worker (an nvme run hung so after Ctrl-C, now and then).
    The block sends such a signal again a moment later, outside the lock code."""
    import signal
    import threading
    import time

    cond = threading.Condition()
    main = threading.main_thread().ident
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with signals_unwind():
            for trial in range(60):   # (before the re-send, about every other trial left it held)
                go = threading.Event()

                def send(go=go, trial=trial):
                    go.wait()
                    time.sleep(trial % 9 * 1e-4)   # (anywhere in the loop's few instructions)
                    signal.pthread_kill(main, signal.SIGINT)
                sender = threading.Thread(target=send)
                sender.start()
                with pytest.raises(KeyboardInterrupt):
                    go.set()
                    while True:
                        with cond:
                            pass
                sender.join()
                assert not cond._is_owned(), f"trial {trial}: the Ctrl-C left the lock held"
    finally:
        signal.signal(signal.SIGINT, before)


@contextlib.contextmanager
def _ctrl_c_soon():
    """A timer (not started) that sends the main thread a SIGINT 0.2 s after its start, under Python's own
    handler; the timer is cancelled and the handler put back on leaving."""
    import signal
    import threading

    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(0.2, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
    try:
        yield timer
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, before)


def test_a_ctrl_c_still_breaks_a_main_thread_blocked_for_good_on_a_lock():
    """The re-sends from lock code are bounded: a main thread waiting for good to take a lock another thread
    holds (a deadlock) still ends on Ctrl-C, a second or so later."""
    import threading
    import time

    cond, held, done = threading.Condition(), threading.Event(), threading.Event()

    def hold():
        with cond:
            held.set()
            done.wait(30)
    holder = threading.Thread(target=hold)
    holder.start()
    held.wait()
    try:
        with _ctrl_c_soon() as timer, signals_unwind():
            timer.start()
            start = time.monotonic()
            with pytest.raises(KeyboardInterrupt):
                with cond:
                    pass
            assert time.monotonic() - start < 20
    finally:
        done.set()
        holder.join()


@pytest.mark.parametrize("blocked", ["join", "wait without the stdlib's sources"])
def test_a_ctrl_c_during_a_join_or_a_wait_is_acted_on_at_once(blocked, monkeypatch):
    """A main thread blocked in a join (Python 3.13 blocks in ``Thread.join`` itself) or in a Condition's wait
    takes Ctrl-C at once, not after the lock code's re-sends (a second or more), also on a Python installed
    without its .py sources, where ``linecache`` gives an empty line."""
    import linecache
    import threading
    import time

    done = threading.Event()
    worker = threading.Thread(target=done.wait, args=(30,))
    if blocked != "join":
        monkeypatch.setattr(linecache, "getline", lambda *args, **kwargs: "")
    try:
        with _ctrl_c_soon() as timer, signals_unwind():
            worker.start()
            timer.start()
            start = time.monotonic()
            with pytest.raises(KeyboardInterrupt):
                worker.join(30) if blocked == "join" else threading.Event().wait(30)
            elapsed = time.monotonic() - start
    finally:
        done.set()
        worker.join()
    assert elapsed < 1.0, f"the Ctrl-C was acted on {elapsed:.2f} s after it was sent at 0.2 s"


def test_a_rank_takes_the_same_ctrl_c_once_and_a_second_one_again():
    """Ctrl-C reaches a rank from the terminal and again from its launcher, as ``INTERRUPT``: the copy is
    ignored however late it is run, a deliberate second Ctrl-C (a SIGINT) cuts the rank's cleanup short; a
    Ctrl-C sent to the launcher alone reaches the rank as ``INTERRUPT`` only. A rank starts with SIGINT
    ignored and gets its handler all the same; one that left ignores both (it is ending: one passed on
    just then must neither print a traceback nor kill it)."""
    import signal

    from framework.cli import launch

    before = signal.signal(signal.SIGINT, signal.SIG_IGN)   # as _spawn starts a rank
    try:
        with signals_unwind(rank=True):
            with pytest.raises(KeyboardInterrupt):
                signal.raise_signal(signal.SIGINT)
            signal.raise_signal(launch.INTERRUPT)   # the launcher's copy
            with pytest.raises(KeyboardInterrupt):
                signal.raise_signal(signal.SIGINT)
        with signals_unwind(rank=True):
            with pytest.raises(KeyboardInterrupt):
                signal.raise_signal(launch.INTERRUPT)
            signal.raise_signal(launch.INTERRUPT)
        assert signal.getsignal(signal.SIGINT) is signal.getsignal(launch.INTERRUPT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)


def test_ranks_start_with_sigint_ignored_and_the_launcher_keeps_its_handler(monkeypatch):
    import signal
    from types import SimpleNamespace

    from framework.cli import launch

    seen = []

    def start_processes(*args, **kwargs):
        seen.append(signal.getsignal(signal.SIGINT))
        raise RuntimeError("started")

    monkeypatch.setattr(launch.mp, "start_processes", start_processes)
    # as a terminal's Python has it (a test run in the background starts with SIGINT ignored)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(RuntimeError, match="started"):
            cfg = SimpleNamespace(dist=SimpleNamespace(nproc=2), choices={"offload": "none"})
            launch._spawn(cfg, None, None)
        assert seen == [signal.SIG_IGN] and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, before)


def _stand_in_rank(w: int, stubborn: bool, started) -> None:
    """A rank for ``_stop``: writes each signal it gets to ``w``; ``stubborn``: a cleanup that never ends."""
    import signal
    import time

    def got(signum, frame):
        os.write(w, bytes([signum]))
        if not stubborn:
            os._exit(0)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, got)
    started.set()
    time.sleep(60)


def _stand_ins(stubborn: bool, n: int = 2) -> tuple[list, list[int]]:
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    ranks, reads = [], []
    for _ in range(n):
        r, w = os.pipe()
        started = ctx.Event()
        p = ctx.Process(target=_stand_in_rank, args=(w, stubborn, started))
        p.start()
        os.close(w)
        assert started.wait(30)
        ranks.append(p)
        reads.append(r)
    return ranks, reads


def _signals(r: int) -> list[int]:
    got = b""
    while chunk := os.read(r, 16):
        got += chunk
    os.close(r)
    return list(got)


def test_a_second_ctrl_c_while_the_ranks_clean_up_ends_them(monkeypatch):
    """Ctrl-C again while the launcher waits for its ranks' cleanup: SIGTERM at once, then SIGKILL; it never
    leaves with ranks running (multiprocessing would wait for them forever at exit)."""
    import signal
    import threading
    import time

    from framework.cli import launch

    monkeypatch.setattr(launch, "KILL_AFTER_S", 0.5, raising=False)
    ranks, reads = _stand_ins(stubborn=True)
    # as a terminal's Python has it (a test run in the background starts with SIGINT ignored)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Timer(0.5, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT)).start()
        start = time.monotonic()
        try:
            launch._stop(ranks, signal.SIGINT)
        except KeyboardInterrupt:
            pytest.fail("the second Ctrl-C left _stop with the ranks still running")
        assert not any(p.is_alive() for p in ranks) and time.monotonic() - start < 20
        assert [p.exitcode for p in ranks] == [-signal.SIGKILL] * 2
        assert [_signals(r) for r in reads] == [[launch.INTERRUPT, signal.SIGTERM]] * 2
    finally:
        signal.signal(signal.SIGINT, before)
        for p in ranks:
            p.kill()


def test_a_sigterm_while_the_ranks_clean_up_ends_them_and_is_raised(monkeypatch):
    """``kill <launcher>`` during the grace after Ctrl-C: SIGTERM to the ranks, SIGKILL after
    ``KILL_AFTER_S``, then the SystemExit goes on; no rank is left running."""
    import signal
    import threading

    from framework.cli import launch

    monkeypatch.setattr(launch, "KILL_AFTER_S", 0.5, raising=False)
    ranks, reads = _stand_ins(stubborn=True)
    try:
        with pytest.raises(SystemExit) as stopped, signals_unwind():
            threading.Timer(0.5, signal.pthread_kill, (threading.main_thread().ident, signal.SIGTERM)).start()
            launch._stop(ranks, signal.SIGINT)
        assert stopped.value.code == 128 + signal.SIGTERM
        assert not any(p.is_alive() for p in ranks), "ranks left running"
        assert [p.exitcode for p in ranks] == [-signal.SIGKILL] * 2
        assert [_signals(r) for r in reads] == [[launch.INTERRUPT, signal.SIGTERM]] * 2
    finally:
        for p in ranks:
            p.kill()


@pytest.mark.parametrize("first", ["SIGINT", "SIGTERM"])
def test_ranks_that_ignore_the_signal_are_killed_after_the_grace(monkeypatch, first):
    """A rank waiting in C++ (a rendezvous) runs no handler: after ``STOP_GRACE_S`` SIGTERM, after
    ``KILL_AFTER_S`` more SIGKILL; the launcher never waits for it without a limit."""
    import signal
    import time

    from framework.cli import launch

    monkeypatch.setattr(launch, "STOP_GRACE_S", 0.5)
    monkeypatch.setattr(launch, "KILL_AFTER_S", 0.5)
    ranks, reads = _stand_ins(stubborn=True)
    try:
        start = time.monotonic()
        launch._stop(ranks, getattr(signal, first))
        assert time.monotonic() - start < 20 and [p.exitcode for p in ranks] == [-signal.SIGKILL] * 2
        assert [_signals(r) for r in reads] == [[launch.INTERRUPT if first == "SIGINT" else signal.SIGTERM,
                                                 signal.SIGTERM]] * 2
    finally:
        for p in ranks:
            p.kill()


def _orphan(w: int, launcher: int) -> None:
    """A rank whose launcher dies: notes ``INTERRUPT`` and ignores it, as a rank waiting in C++ would."""
    import signal
    import time

    from framework.cli import launch

    launch.STOP_GRACE_S, launch.KILL_AFTER_S = 0.2, 0.2
    signal.signal(launch.INTERRUPT, lambda signum, frame: os.write(w, bytes([signum])))
    launch._die_with(launcher)
    time.sleep(30)


def _launcher(w: int) -> None:
    import multiprocessing

    multiprocessing.get_context("fork").Process(target=_orphan, args=(w, os.getpid())).start()
    os._exit(0)   # (as if killed: nothing stops the rank)


def test_a_rank_whose_launcher_died_is_interrupted_then_killed():
    """A launcher killed with -9 cannot stop its ranks: each gets ``INTERRUPT`` (a Ctrl-C), and SIGKILL after the
    grace where it does not end (waiting in C++); none trains on without the run folder's lock."""
    import multiprocessing
    import time

    from framework.cli import launch

    ctx = multiprocessing.get_context("fork")
    r, w = os.pipe()
    start = time.monotonic()
    launcher = ctx.Process(target=_launcher, args=(w,))
    launcher.start()
    os.close(w)
    launcher.join(30)
    assert _signals(r) == [launch.INTERRUPT] and time.monotonic() - start < 20   # (EOF: the rank ended)


def test_ctrl_c_goes_on_only_to_ranks_whose_handlers_are_installed():
    """A rank still starting (importing torch) would print a KeyboardInterrupt traceback: it gets SIGTERM,
    whose default ends it silently."""
    import signal

    from framework.cli import launch

    ranks, reads = _stand_ins(stubborn=False)
    try:
        launch._stop(ranks, signal.SIGINT, lambda rank: rank == 0)
        assert [_signals(r) for r in reads] == [[launch.INTERRUPT], [signal.SIGTERM]]
    finally:
        for p in ranks:
            p.kill()


def test_a_sigterm_inside_the_first_close_still_closes_the_engine_and_the_logger(monkeypatch, tmp_path):
    """torch's spawn sends SIGTERM to the surviving ranks just as they unwind from a peer's failure: its
    SystemExit landing in the checkpointer's close still lets the engine (swap files) and the logger
    (the W&B run) close, and stays the exception raised (exit 143)."""
    from framework.cli.launch import launch
    from framework.engine.build import Engine
    from framework.loggers import RunInfo, RunRecord
    from framework.persist.checkpoint import Checkpointer
    from tests._helpers import tiny_config

    closed = []

    def sigterm(self):
        closed.append("checkpointer")
        raise SystemExit(143)

    def recorded(name, close, then=None):
        def wrapper(self):
            closed.append(name)
            close(self)
            if then is not None:
                raise then
        return wrapper

    monkeypatch.setattr(Checkpointer, "close", sigterm)
    monkeypatch.setattr(Engine, "close", recorded("engine", Engine.close))
    # (a later close's error does not mask the first's)
    monkeypatch.setattr(RunRecord, "close", recorded("logger", RunRecord.close, OSError("disk gone")))

    def fail(point):
        if point == "step:1":
            raise RuntimeError("a peer failed")

    cfg = tiny_config("train.steps=3", "train.eval_batches=1")
    with pytest.raises(SystemExit) as e:
        launch(cfg, RunInfo(tmp_path / "run", None, None), on_point=fail)
    assert e.value.code == 143 and closed == ["checkpointer", "engine", "logger"], closed


DS_BATCH = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2}


def test_a_deepspeed_batch_divided_over_another_world_than_the_runs_is_refused(monkeypatch, tmp_path):
    """A DeepSpeed file's train_batch_size is divided over the world size known at composition: a Slurm task
    of Hydra's submitit launcher composed before its rank variables were set (1 rank) would run 2 ranks with
    twice the file's global batch. One line instead; a file without a batch, or one composed for the run's
    world, passes."""
    from framework.cli.launch import launch
    from framework.config import check_batch_world
    from framework.core.errors import ConfigError
    from framework.loggers import RunInfo

    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "SUBMITIT_EXECUTOR", "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_ID", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(key, raising=False)
    cfg = compose(["train.steps=1", "logger=none"], ds_config=DS_BATCH)
    assert (cfg.batch_world, cfg.train.grad_accum) == (1, 4)
    if _installed("submitit"):   # two tasks of one node, as submitit starts them (this is task 1)
        for key, value in {"SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_ID": "4243", "SLURM_NTASKS": "2",
                           "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_LOCALID": "1",
                           "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_NUM_NODES": "1",
                           "SLURM_TASKS_PER_NODE": "2"}.items():
            monkeypatch.setenv(key, value)
        saved = dict(os.environ)
        try:   # (launch sets the rank variables of the Slurm task in this process's environment)
            with pytest.raises(ConfigError) as e:
                launch(cfg, RunInfo(tmp_path / "run", None, None))
        finally:   # put back as it was: monkeypatch would restore what launch set (a later in-process
            os.environ.clear()   # launch would wait for a rendezvous of 2 ranks)
            os.environ.update(saved)
        assert ("train_batch_size=8 was divided over 1 rank when the config was composed, but this run has 2 "
                "(a global batch of 16)" in str(e.value) and "\n" not in str(e.value)), str(e.value)
        assert not (tmp_path / "run").exists()
        for key in ("SUBMITIT_EXECUTOR", "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_ID"):
            monkeypatch.delenv(key, raising=False)
    with pytest.raises(ConfigError, match="divided over 1 rank"):   # local ranks other than composed for
        check_batch_world(compose(["train.steps=1", "dist.nproc=2"], ds_config=DS_BATCH, world=1), 2)
    check_batch_world(cfg, 1)
    two = compose(["train.steps=1", "dist.nproc=2"], ds_config=DS_BATCH)
    assert (two.batch_world, two.train.grad_accum) == (2, 2)
    check_batch_world(two, 2)
    with pytest.raises(ConfigError, match=r"divided over 2 ranks .* compose it for 1 rank \(framework"):
        check_batch_world(two, 1)
    no_batch = compose(["train.steps=1", "dist.nproc=2"], ds_config={"gradient_clipping": 0.5}, world=1)
    assert no_batch.batch_world is None
    check_batch_world(no_batch, 2)
    # the library's path: a config composed in a parent for another world than the group's
    import framework
    from framework.comm.distributed import connect
    from framework.models.gpt import gpt_loss
    from tests._helpers import TINY, build_gpt, tiny_config
    module, _ = build_gpt(tiny_config())
    with pytest.raises(ConfigError, match="divided over 2 rank.*this run has 1"):
        framework.initialize(module, gpt_loss, compose([*TINY, "train.steps=1"], ds_config=DS_BATCH, world=2),
                             connect("gloo"))


@needs_submitit
def test_a_sweep_on_the_submitit_launcher_divides_a_deepspeed_batch_over_its_tasks(monkeypatch, tmp_path):
    """The jobs are composed on the submitting host, where no rank variable says the world: the launcher's
    nodes x tasks_per_node (each task a rank) is the world a DeepSpeed file's batch is divided over."""
    import sys

    from framework.cli import train

    for key in ("WORLD_SIZE", "RANK", "SUBMITIT_EXECUTOR"):
        monkeypatch.delenv(key, raising=False)
    # (a file naming all three keys is consistent only for 4 ranks: at 1 it would be refused)
    for i, text in enumerate(('{"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2}',
                              '{"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2, '
                              '"gradient_accumulation_steps": 4}')):
        ds = tmp_path / f"ds{i}.json"
        ds.write_text(text)
        seen = []
        monkeypatch.setattr(train, "_app", lambda configs, *args: seen.append(configs) or (lambda: None))
        monkeypatch.setattr(sys, "argv", ["train", "-m", "--config-dir", str(CLUSTER), "--config-name", "config",
                                          f"ds_config={ds}", "hydra.launcher.nodes=1", "hydra.launcher.tasks_per_node=4",
                                          f"hydra.sweep.dir={tmp_path / 'multirun'}"])
        train.main()
        (config,), = (list(c.values()) for c in seen)
        assert (config.batch_world, config.train.micro_batch, config.train.grad_accum) == (4, 2, 4), text


@needs_submitit
def test_a_bug_in_a_task_of_the_submitit_launcher_is_printed_in_that_tasks_own_log(forkrun, tmp_path):
    """Hydra's submitit launcher keeps a job's exception in the task's result and reads task 0's alone: each
    task prints its traceback and its one line to its own error log (under Slurm, rank 1's too) before that."""
    p = forkrun.run("tests._fault_train", [
        "-m", "hydra/launcher=submitit_local", "train.steps=2", "train.eval_every=0", "train.eval_batches=1",
        "model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.context=16",
        f"hydra.sweep.dir={tmp_path / 'sweep'}"], cwd=tmp_path,
        env={"WANDB_MODE": "offline", "FRAMEWORK_FAULT": "step:1@0,raise"})
    assert p.returncode == 1 and "FRAMEWORK_FAULT: rank 0 raises at step:1" in p.stderr, p.stderr[-3000:]
    log = "".join(f.read_text() for f in (tmp_path / "sweep").rglob("*_0_log.err"))
    line = f"error: job 0 ({tmp_path / 'sweep' / '0'}) failed: RuntimeError: FRAMEWORK_FAULT: rank 0 raises at step:1"
    assert line in log.splitlines() and log.index("Traceback") < log.index(line), log[-3000:]


def test_a_ranks_error_file_that_is_missing_empty_or_odd_gives_no_traceback(tmp_path):
    """torch's spawn pickles a raising rank's traceback to a file; one never written (the rank exited on its own),
    cut short (a full temporary folder) or holding something else leaves the launcher's exit-code line, not a crash."""
    import pickle

    from framework.cli.launch import _traceback

    (tmp_path / "ok").write_bytes(pickle.dumps("Traceback ...\nRuntimeError: boom\n"))
    (tmp_path / "empty").write_bytes(b"")
    (tmp_path / "odd").write_bytes(pickle.dumps(17))
    assert _traceback(str(tmp_path / "ok")) == "Traceback ...\nRuntimeError: boom"
    assert [_traceback(str(tmp_path / n)) for n in ("missing", "empty", "odd")] == [None, None, None]


def test_a_ranks_error_line_names_the_rank_once():
    from framework import ConfigError, DistributedError
    lost = DistributedError("rank 0/2: rank 1 lost (process gone) during checkpoint writing the files")
    assert error_line(0, lost) == "error: rank 0/2: rank 1 lost (process gone) during checkpoint writing the files"
    assert error_line(1, ConfigError("bad key")) == "error: rank 1: bad key"
