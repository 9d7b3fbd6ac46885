"""Sharded, atomic checkpoints in torch.distributed.checkpoint's format, keyed by parameter name.

    ckpt = Checkpointer(cfg, engine, run_dir=run_dir)   # collective: makes the checkpoint gloo group
    state = ckpt.resume(state)                   # checkpoint.resume: auto | off | latest | PATH
    ...  ckpt.maybe_save(state, metrics=m)  ...  # every checkpoint.every steps (and the last)
    ckpt.close()                                 # waits for an async save; collective

A step folder holds DCP's files ("model.<name>" masters, "optim.<state>.<name>", "optim.<scalar>", rank 0's
"buffer.<name>" and "frozen.<name>"), train_state.json, rng-<rank>.json and manifest.json (``stepfolders``).
Each rank writes its share of the name-keyed state (``layout``) and reads its holdings by name, so world size,
stage and offload may change between save and load. Every phase ends in an exchange of outcomes.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import os
import secrets
import socket
import sys
from pathlib import Path
from typing import Callable

from framework.config.searchpath import pasted
from framework.core import files
from framework.core.errors import CheckpointError, ConfigError, FrameworkError, UnsafePathError, on_every_rank, say
from framework.core.paths import user_path
from framework.core.registry import closest_hint
from framework.core.room import check_name
from framework.core.utils import counted, few
from framework.persist import stepfolders
from framework.persist.checkpoint._group import Group, agree_load, glue
from framework.persist.checkpoint._lock import HeldLock, identity
from framework.persist.checkpoint._load import (afresh, batch_change, changed, data_change, job_values, load,
                                                other_job, same_run, saves_among, schedule_change, verify)
from framework.persist.checkpoint._save import check_finite, save

__all__ = ["CHECKPOINTS", "Checkpointer", "CheckpointError", "checkpoint_root", "glue", "identity", "preflight",
           "shared", "verify"]


# A refused load may have read part of a checkpoint into the state's tensors (DCP reads in place).
SPENT = "; the state given to resume may be partly overwritten: do not train from it"
# What a run that resumes nothing goes on from (a given trained state is kept: ``Checkpointer.resume``).
FROM_0 = "starting from step 0"


class Checkpointer:
    """Periodic saves and the resume of one training run, as ``cfg.checkpoint`` says."""

    def __init__(self, cfg, engine, job: str | None = None, run_dir: Path | None = None,
                 on_point: Callable[[str], None] | None = None, batch_from_config: bool = False,
                 data: dict | None = None, lock: tuple[int, int] | None = None):
        """``run_dir``, ``job``: see ``checkpoint_root``. ``on_point``: ``save``'s (fault tests). ``data``: the data's
        ``DataSource.identity()``, saved with each checkpoint: a resume refuses a changed vocabulary (its ids would
        stand for other characters) and says when only the content changed. ``batch_from_config``: batches are
        ``train.micro_batch`` x ``train.grad_accum`` rows (the CLI's): a resume says when the global batch changed.
        ``lock``: the (device, inode) of the folder's lock file the caller holds (the CLI's), checked before each save
        (``HeldLock``)."""
        self.cfg, self.config, self.seed, self.engine = cfg.checkpoint, cfg.to_dict(), cfg.seed, engine
        self.run_cfg = cfg   # (a resume's note rebuilds its lr schedule over the saved run's length)
        self.batch_from_config, self.data = batch_from_config, data
        self.resume_given = cfg.resume_given or cfg.checkpoint.resume   # what messages say (latest as typed)
        self.root = checkpoint_root(cfg, run_dir, job)
        self.on_nonfinite, self.on_point = cfg.train.on_nonfinite, on_point
        self.lock = HeldLock(self.root, lock) if lock is not None else None
        self.group = Group(engine.components.dist, self.cfg.timeout_s)
        self.rank = self.group.rank
        # DCP's writer queries the current CUDA stream on this thread: bound, or it opens a context on GPU 0
        self.pool = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="checkpoint", initializer=engine.components.dist.acc.bind_thread) \
            if self.cfg.async_ else None
        self._pending: concurrent.futures.Future | None = None
        self.writer = None   # DCP's storage writer, None: FileSystemWriter (tests put one that fails on purpose here)
        self.resumed_from: Path | None = None   # the checkpoint folder ``resume`` loaded
        self.recent_losses: list[float] = []   # the last steps' losses it recorded (``save``'s ``losses``)
        self.closed = False   # close() ended its group (and async pool): no save or resume after it
        self._said_none = False   # that checkpoint.every=0 saves nothing (maybe_save, once)

    def _say(self, msg: str) -> None:
        if self.rank == 0:
            print(f"checkpoint: {msg}", flush=True)

    def resume(self, state):
        """The state loaded from the checkpoint ``checkpoint.resume`` selects, or ``state`` (saying why). Collective."""
        self._check_open("resume")
        self.wait()   # an async save in flight: its step is the newest (else an older one, or none, is read)
        resume, every, given = self.cfg.resume, self.cfg.every, self.resume_given
        what = "checkpoint.resume=off" if resume == "off" else \
            f"looking for checkpoint.resume={resume} in {self.root} (another checkpoint.dir starts afresh)"
        # (a loop of one's own may pass a trained state: it is kept, not step 0)
        start = FROM_0 if state.step == 0 else f"keeping the given state (step {state.step})"
        folders, notes = self._choose(what, resume, every, start)
        for note in notes:   # never passed over silently
            self._say(note)
        if not folders:
            if resume == "auto" and every:
                self._say(f"resume=auto: no checkpoint in {self.root}; {start}")
            return state
        errors, spent, relisted = [], "", False   # SPENT once a read began (it may have written into the state)
        for i, folder in enumerate(folders):
            try:
                read = load(self.engine, state, folder, group=self.group, seed=self.seed, same=(self.config, given),
                            data=self.data, way=self.afresh(folder))
                spent = SPENT
                state, body = read()
            except CheckpointError as e:
                # Read where it lay (step-N.tmp or .old: another run's commit under way), and that commit has put
                # step-N in place since: a read that lost that race is no damage; step-N is tried next. Rank 0 looks.
                final = stepfolders.held_for(folder)
                if final is not None and self.group.all_gather(self.rank == 0 and final.is_dir(),
                                                               "resume: step moved in")[0]:
                    folders.insert(i + 1, final)
                    continue
                # Gone since it was listed: a live run saving there rotated it away (no damage). The folder is
                # listed again, once: that run's newest steps are read; else one line naming that run.
                if self.group.all_gather(self.rank == 0 and not os.path.lexists(folder), "resume: step removed")[0]:
                    if relisted or (again := self._relist(what, resume, every)) is None:
                        gone = stepfolders.removed_while_read(
                            folder, "run again, or resume from a step that run keeps (checkpoint.keep_last)")
                        raise on_every_rank(FrameworkError(f"checkpoint.resume={given}: {gone}{spent}"))
                    relisted, folders[i + 1:] = True, again
                    continue
                if resume != "auto" and len(folders) == 1:   # the one folder asked for: no other choice
                    # (read alike on every rank: one line). Not that step by name: it may be damaged too, and
                    # two such lines would name each other. A resume of their folder falls back past each
                    # damaged one and reads that folder only (latest would also take another run's newer step).
                    older = stepfolders.newest_other(Path(folder))
                    out = (f"; {pasted('checkpoint.resume', str(Path(folder).parent))} falls back to the "
                           "newest step there that verifies" if older else "")
                    raise on_every_rank(CheckpointError(f"{e}{out}{spent}"), e.every_rank) from None
                errors.append(str(e))
                # Every rank says it, before any training: no rank goes on from a state the others refused.
                then = (f"falling back to the previous checkpoint, {folders[i + 1]}" if i + 1 < len(folders)
                        else "no older checkpoint is left")
                say(f"rank {self.rank}: {e}; {then}", sys.stdout)
                continue
            except FrameworkError as e:
                e.args = (f"{e}{spent}", *e.args[1:])
                raise
            how = (f"resharded from {counted(body['world'], 'rank')}, stage {body['stage']}; RNG re-derived"
                   if body["world"] != self.group.world else f"resharded from stage {body['stage']}"
                   if body["stage"] != self.config["stage"]["name"] else "same layout")
            if every and Path(folder).parent.resolve() == self.root.resolve():   # (preflight's check, for a loop)
                agree_load(self.group, "resume: newer steps", lambda: stepfolders.refuse_newer_above(
                    Path(folder), self.config["train"]["steps"]) if self.rank == 0 else None)
            self.resumed_from = Path(folder)
            losses = body.get("recent_losses")   # (none in a checkpoint of an older version)
            self.recent_losses = [x for x in losses if isinstance(x, (int, float)) and not isinstance(x, bool)] \
                if isinstance(losses, list) else []
            # (a dynamic scale goes on from the saved one: a new initial scale is not used)
            goes_on = body["dynamic_loss_scale"] is True and self.config["precision"].get("loss_scale") == 0
            diff = changed(body["config"], self.config, values=True, notes={
                "precision.initial_scale_power": f"the saved scale {state.precision.cur_scale:g} carries on"}
                if goes_on else None)
            batch = self.batch_from_config and batch_change(body["config"], body["world"], self.config,
                                                            self.group.world)
            data = data_change(body.get("data_identity"), self.data)   # (another vocabulary: refused by load)
            lr = schedule_change(body["config"], self.run_cfg, state.applied_steps)
            named = stepfolders.named_step(Path(folder))   # (another step's whole folder copied in: said)
            self._say(f"resumed from {folder} (step {body['step']}, data position {body['data']}; {how})"
                      + (f"; note: its name says step {named} but it holds step {body['step']}'s files (copied "
                         f"from another step's folder?)" if 0 <= named != body["step"] else "")
                      + (f"; config differs in {', '.join(diff)}" if diff else "")
                      + (f"; {lr}" if lr else "")
                      + (f"; {batch}" if batch else "")
                      + (f"; the data in {self.data['path']} changed since the save ({data[0]}, same vocabulary): "
                         "training goes on with its new rows" if data else ""))
            return state
        way = self.afresh(folders[0]) + ("" if saves_among(folders[0], self.root, every) else
                                         ", or checkpoint.resume to a good checkpoint's step-<N> folder")
        raise on_every_rank(CheckpointError(   # (each fallback came after an agreed one: so does this)
            f"checkpoint.resume={given}: every checkpoint in {folders[0].parent} is damaged or not finite (the "
            f"folders are kept; {way}): " + " | ".join(errors) + spent))

    def _relist(self, what: str, resume: str, every: int) -> list[Path] | None:
        """``_choose``'s folders again, None where ``resume`` names one step."""
        if resume not in ("auto", "latest") and stepfolders.step_of(Path(user_path(resume))) >= 0:
            return None
        return self._choose(what, resume, every)[0] or None

    def _choose(self, what: str, resume: str, every: int, start: str = FROM_0) -> tuple[list[Path], list[str]]:
        """``choose``'s (folders, notes): rank 0 looks, every rank gets its answer (or its error: none left waiting)."""
        mine = agree_load(self.group, what, lambda: choose(resume, self.root, every, start=start) if self.rank == 0
                          else None)
        return self.group.all_gather(mine, "resume choice")[0]

    def afresh(self, folder: Path) -> str:
        """``afresh``'s advice for ``folder`` in this run."""
        return afresh(self.resume_given, Path(folder), self.root, self.cfg.every)

    def maybe_save(self, state, last: bool = False, metrics: dict | None = None,
                   losses: list[float] | None = None) -> None:
        """Every ``checkpoint.every`` steps and at the ``last``, unless the step's ``metrics`` were not finite."""
        if not self.cfg.every and not self._said_none:   # (compose's default): said once, not passed over silently
            self._said_none = True
            self._say("none saved (checkpoint.every=0): maybe_save saves nothing; set checkpoint.every=N to save "
                      "every N steps and at last=True, or call ckpt.save(state)")
        if self.cfg.every and (state.step % self.cfg.every == 0 or last):
            if metrics is not None and metrics.get("nonfinite"):
                self._say(f"not saving step {state.step}: its loss or gradient norm was not finite "
                          f"(train.on_nonfinite=warn); the previous checkpoints are kept")
                return
            self.save(state, losses)

    def save(self, state, losses: list[float] | None = None) -> None:
        """``losses``: the last steps' losses, recorded for a resume to go on from (``recent_losses``)."""
        self._check_open("save")
        self.wait()
        self._pending = save(self, state, losses)

    def check_finite(self, state, doing: str) -> None:
        """A save's check that ``state`` is finite, alone, before ``doing``: a TrainingError on every rank."""
        self._check_open("check")
        check_finite(self, state, doing)

    def wait(self) -> None:
        """Wait for a save in flight; its error is raised here."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def _check_open(self, what: str) -> None:
        if self.closed:
            raise FrameworkError(f"checkpoint {what}: this Checkpointer is closed (ckpt.close()); save and resume "
                                 f"before closing it, or make a new Checkpointer(cfg, engine, ...)")

    def close(self) -> None:
        self.closed = True
        try:
            self.wait()
        finally:
            if self.pool is not None:
                self.pool.shutdown(wait=True)
            self.group.close()
            if self.lock is not None:
                self.lock.close()


# The checkpoint root in a run folder (or the working directory) when checkpoint.dir is unset.
CHECKPOINTS = "checkpoints"


def checkpoint_root(cfg, run_dir: Path | None, job: str | None = None) -> Path:
    """``checkpoint.dir`` (a multirun ``job``, its overrides, gets ``<dir>/<job>``: jobs never resume each other's),
    else ``checkpoints/`` in the run folder, else in the working directory."""
    c = cfg.checkpoint
    if c.dir is None:
        return (Path(run_dir) if run_dir is not None else Path.cwd()).resolve() / CHECKPOINTS
    root = Path(user_path(c.dir)).resolve()
    if not job:
        return root
    name = job.replace("/", "_")   # readable, and short enough for any file system
    return root / (name if len(name) <= 120 else f"{name[:100]}-{hashlib.sha256(job.encode()).hexdigest()[:12]}")


# Where ``checkpoint.resume=latest`` also looks: Hydra's run folders under the working directory.
_RUN_TREES = ("outputs", "multirun")


def find_latest(root: Path, sweep_dir: Path | None = None, owned: Path | None = None,
                values: dict | None = None) -> Path | None:
    """The newest committed checkpoint (by commit time) in ``root`` and the ``checkpoints`` folders one to three
    levels under the run trees, or None; passed over, said: the sweep's (``sweep_dir``) other jobs' and, outside
    ``root``, any saved with other ``values`` of the job's keys. A step a commit moved aside counts (``_scan``)."""
    skip = Path(sweep_dir).resolve() if sweep_dir is not None else None
    roots = {root, *(p for tree in _RUN_TREES for depth in ("*", "*/*", "*/*/*")
                     for p in (Path.cwd() / tree).glob(f"{depth}/checkpoints") if p.is_dir() and not p.is_symlink()
                     and (skip is None or skip not in p.resolve().parents))}
    owned = owned.resolve() if owned is not None else None
    newest = sorted((found[0] for found, _ in (_scan(r, r.resolve() == owned) for r in roots) if found),
                    key=lambda p: (p / stepfolders.MANIFEST).stat().st_mtime, reverse=True)
    passed, found = [], None   # (another job's state: its numbers would be reported under this job's overrides)
    for folder in newest:   # (``root``'s own: ``preflight`` refuses another job's there, as auto's)
        if folder.parent.resolve() == root.resolve() or not (other := _other_job(folder, values)):
            found = folder
            break
        passed.append(f"{folder}: {', '.join(theirs for theirs, _ in other)}")
    if passed:
        print(f"checkpoint: resume=latest: passed over {counted(len(passed), 'checkpoint')} saved with other values of "
              f"this job's overrides (newest {passed[0]})", flush=True)
    return found


def _other_job(folder: Path, values: dict | None) -> list[tuple[str, str]]:
    """``other_job`` of ``folder``'s recorded config; none where it is unreadable (damage is the load's)."""
    if not values:
        return []
    try:
        return other_job(stepfolders.read_json(folder / stepfolders.TRAIN_STATE, "the train state")["config"], values)
    except (CheckpointError, KeyError, TypeError, AttributeError):
        return []


def preflight(cfg, run_dir: Path | None, job: str | None = None, sweep_dir: Path | None = None,
              own: Callable[[Path], None] | None = None, naming: frozenset[str] = frozenset()):
    """Before any rank starts: ``cfg`` with resume=latest resolved to a path (every rank loads the same); another
    model's or optimizer's checkpoint refused on one line, damage left to the ranks. ``own(folder)``: for a run that
    saves, once its folder is made and writable, before anything in it is read (the CLI locks it). ``naming``: a
    multirun job's keys; ``auto`` refuses a checkpoint saved with other values of them, ``latest`` passes over one."""
    c = cfg.checkpoint
    for key, given in (("checkpoint.dir", c.dir), ("checkpoint.resume", c.resume)):   # (ENAMETOOLONG: a traceback)
        check_name(given or ".", key)
    root = checkpoint_root(cfg, run_dir, job)
    if c.every:   # an unwritable folder is found now, not at the first save (hours later): made as a save would
        try:
            files.make_dirs(root)
            files.probe_writable(root)
        except OSError as e:
            raise ConfigError(f"checkpoint folder {root} is not writable ({e.strerror or e}); set checkpoint.dir to "
                              "a writable folder, or checkpoint.every=0 to save nothing") from None
        if own is not None:
            own(root)
    mine = job_values(cfg.to_dict(), naming)
    folders, notes = choose(c.resume, root, c.every, sweep_dir, mine)
    if c.resume == "latest":   # resolved once, here, so that every rank loads the same
        if not folders:
            print(f"checkpoint: {notes[0]}", flush=True)
            return dataclasses.replace(cfg, checkpoint=dataclasses.replace(c, resume="off"), resume_given=c.resume)
        # That run's checkpoint folder, not its newest step folder alone: a damaged newest one falls
        # back to the one before it, as resume=auto does.
        cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(c, resume=str(folders[0].parent)),
                                  resume_given=c.resume)
    if not folders:   # (resume=off too)
        return cfg
    folder = folders[0]   # the one every rank reads first
    if c.every and folder.parent.resolve() == root.resolve():   # a step of a newer version this run's saves reach
        # (later steps of this version: not refused, rolling back past a loss spike is what such a resume is for)
        if later := stepfolders.refuse_newer_above(folder, cfg.train.steps):
            one = len(later) == 1
            print(f"checkpoint: resuming {folder.name} in {root}, which holds the later {few(later, 4, str)}: this "
                  f"run saves over or rotates out {'that step' if one else 'those steps'} as it goes; set "
                  f"checkpoint.dir to another folder to keep {'it' if one else 'them'}", flush=True)
    try:   # a train state that fails its manifest check is damage: the ranks name it and fall back
        want = stepfolders.read_manifest(folder)["files"][stepfolders.TRAIN_STATE]
        if stepfolders.check_file(folder, stepfolders.TRAIN_STATE, want) is not None:
            return cfg
        body = stepfolders.read_json(folder / stepfolders.TRAIN_STATE, "the train state")
        stepfolders.train_state_versions(body, folder)   # (a newer version's keys are not this one's to compare)
        saved = body["config"]
    except (CheckpointError, UnsafePathError, OSError, KeyError, TypeError, stepfolders.NewerVersion):
        return cfg   # (damage, or a newer version's: the ranks' load names it)
    # Another job's in the folder this job saves into (a path given is the user's choice; latest passed over
    # another job's elsewhere): it would take on that job's state and report it as its own.
    if c.resume in ("auto", "latest") and folder.parent.resolve() == root.resolve() and (
            other := other_job(saved, mine)):
        raise ConfigError(f"checkpoint.resume={c.resume}: {folder.parent} holds the checkpoint of another job "
                          f"({', '.join(t for t, _ in other)}; this job: {', '.join(m for _, m in other)}): a "
                          "sweep's values in another order, or another sweep, saved there; give this sweep another "
                          "hydra.sweep.dir (or checkpoint.dir), or delete that folder to start this job afresh")
    same_run(folder, saved, cfg.to_dict(), c.resume, body.get("model_config"),   # (the model's own: at the load)
             way=afresh(c.resume, folder, root, c.every))
    return cfg


def shared(dist, root: Path) -> None:
    """A ConfigError on every rank unless every rank sees in ``root`` the file rank 0 writes there (collective): on a
    node-local folder each node would write its own copy of a step folder, which no resume can read."""
    if dist.world == 1:
        return
    token, problem, wrote = secrets.token_hex(16), None, False
    probe = root / f".shared-{token}"
    if dist.rank == 0:
        try:
            files.write_new(probe, token.encode())
            wrote = True
        except OSError as e:
            problem = f"checkpoint folder {root} is not writable ({e.strerror or e}); set checkpoint.dir to a writable " \
                      "folder every rank sees, or checkpoint.every=0 to save nothing"
    try:
        token, problem = dist.all_gather_object((token, problem), what="the checkpoint folder check")[0]
        if problem:
            raise on_every_rank(ConfigError(problem))   # (rank 0's, given to all)
        probe = root / f".shared-{token}"
        try:   # (a random name: no file system has a cached answer for it)
            seen = probe.read_bytes() == token.encode()
        except OSError:
            seen = False
        views = dist.all_gather_object((seen, socket.gethostname()), what="the checkpoint folder check")
    finally:
        if wrote:
            probe.unlink(missing_ok=True)
    blind = [(r, host) for r, (seen, host) in enumerate(views) if not seen]
    if blind:
        r, host = blind[0]
        more = f" (and {counted(len(blind) - 1, 'more rank')})" if len(blind) > 1 else ""
        raise on_every_rank(ConfigError(   # (every rank has every view)
            f"checkpoint.dir {root} is not one folder every rank sees (rank {r} on host {host} does not see the files "
            f"rank 0 on host {views[0][1]} writes there{more}): put it on a shared file system"))


def fresh_start(root: Path, every: int, resume: str = "off", start: str = FROM_0) -> str | None:
    """``checkpoint.resume=off`` (or elsewhere): a ConfigError where this run's saves would overwrite or rotate
    committed checkpoints; else the note to print, if any (``start``: what the run starts from)."""
    existing = _scan(root, owned=bool(every))[0]
    if not existing:
        return None
    what = f"{root} holds {counted(len(existing), 'checkpoint')}, newest {existing[0].name}"
    if every:
        raise ConfigError(f"checkpoint.resume={resume}: {what}, which this run's saves would overwrite or rotate away"
                          + ("" if resume == "off" else " (this resume reads another folder)")
                          + "; set checkpoint.resume=auto to continue from it, or checkpoint.dir to another folder")
    return f"resume=off: {start} although {what}; set checkpoint.resume=auto to continue from it"


def _scan(root: Path, owned: bool) -> tuple[list[Path], list[str]]:
    """``stepfolders.scan`` of ``root`` with a step a commit moved aside (else a resume goes back a save): put back
    first where this run ``owned`` the folder, else read where it lies (a commit may be under way). Rank 0 only."""
    if owned:
        restore(root)
    return stepfolders.scan(root, around=not owned)


def restore(root: Path) -> None:
    """``stepfolders.restore`` in a folder this run saves into; rank 0 only."""
    if not root.is_dir() or root.is_symlink():
        return
    try:
        stepfolders.restore(root)
    except OSError as e:   # e.g. a folder this user may only read: resumed from what is there, said
        print(f"checkpoint: cannot restore an interrupted save's step folder in {root} ({e.strerror or e}); "
              "looking at the committed ones only", flush=True)


def choose(resume: str, root: Path, every: int, sweep_dir: Path | None = None, values: dict | None = None,
           start: str = FROM_0) -> tuple[list[Path], list[str]]:
    """``candidates``, or for ``off`` none and ``fresh_start``'s note (which also refuses another folder's); their
    notes say the run goes on ``start``."""
    if resume == "off":
        note = fresh_start(root, every, start=start)
        return [], [note] if note else []
    folders, notes = candidates(resume, root, sweep_dir, owned=root if every else None, values=values, start=start)
    if folders and every and folders[0].resolve().parent != root.resolve():
        fresh_start(root, every, resume)
    return folders, notes


def candidates(resume: str, root: Path, sweep_dir: Path | None = None, owned: Path | None = None,
               values: dict | None = None, start: str = FROM_0) -> tuple[list[Path], list[str]]:
    """Candidate folders for ``checkpoint.resume`` (auto, latest, a step folder or a folder of them), best first,
    and a line for each ``step-<N>`` passed over (or none found: the run goes on ``start``). ``owned``: the folder
    this run saves into."""
    def mine(folder: Path) -> bool:
        return owned is not None and folder.resolve() == owned.resolve()

    if resume == "auto":
        return _scan(root, mine(root))
    if resume == "latest":   # (the CLI resolved it to a path before the ranks started; a library loop comes here)
        folder = find_latest(root, sweep_dir, owned, values)
        if folder is None:
            others = "" if sweep_dir is None else f" (those of the sweep's other jobs in {sweep_dir} passed over)"
            return [], [f"resume=latest: no checkpoint in {root} or in the run folders under "
                        f"{', '.join(t + '/' for t in _RUN_TREES)}{others}; {start}"]
        return _scan(folder.parent, mine(folder.parent))   # that run's folder: a damaged newest one falls back
    path = Path(user_path(resume))
    if not os.path.lexists(path) and stepfolders.step_of(path) >= 0:
        # a save of that step killed (or under way) inside its commit moved it aside: put back, or read where it lies
        if mine(path.parent):
            restore(path.parent)
        else:
            path = next((p for p, final in stepfolders.interrupted(path.parent) if final == path),
                        path)
    if (path / stepfolders.MANIFEST).is_file() or (path / stepfolders.TRAIN_STATE).exists():
        return [path], []
    if path.is_dir():
        found, notes = _scan(path, mine(path))
        if found:
            return found, notes
    hint = "" if path.exists() else closest_hint(resume, ("auto", "off", "latest"))
    raise ConfigError(f"checkpoint.resume={resume}: no checkpoint there{hint} (expected a step-<N> folder with "
                      f"{stepfolders.MANIFEST}, or a directory holding them); "
                      + (_nearby(path) or "use checkpoint.resume=auto or off"))


def _nearby(path: Path) -> str | None:
    """The checkpoints a ``checkpoint.resume`` path naming none meant: beside a missing step, or a run folder's."""
    run = path.is_dir()
    try:
        steps = stepfolders.scan(path / CHECKPOINTS if run else path.parent)[0]
    except OSError:   # (a folder this user may not list: the plain refusal)
        return None
    if not run:
        return (f"the checkpoints in {path.parent} are {few((p.name for p in steps), show=str)}: set "
                f"checkpoint.resume to one of them, or to {path.parent} for the newest") if steps else None
    return (f"it is a run folder: set checkpoint.resume={path / 'checkpoints'} for its newest checkpoint "
            f"({steps[0].name}), or to one of its step folders") if steps else None

