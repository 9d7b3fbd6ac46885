"""Sharded, atomic checkpoints in torch.distributed.checkpoint's format, keyed by parameter name.

    ckpt = Checkpointer(cfg, engine, run_dir=run_dir)   # collective: makes the checkpoint gloo group
    state = ckpt.resume(state)                   # checkpoint.resume: auto | off | latest | PATH
    ...  ckpt.maybe_save(state, metrics=m)  ...  # every checkpoint.every steps (and the last)
    ckpt.close()                                 # waits for an async save; collective

Folder (``framework.persist.checkpoint._folder`` has the commit protocol)::

    <dir>/step-<N>/.metadata, __<rank>_0.distcp   DCP: "model.<name>" fp32 masters and
                                                    "optim.<state>.<name>" moments with global shapes,
                                                    "optim.<scalar>" (e.g. optim.step)
                   train_state.json                 step, data position, loss scaler, scheduler position,
                                                    optimizer layout, config, world size, stage, fragments
                   rng-<rank>.json                  python / numpy / torch / CUDA generators of each rank
                   manifest.json                    written last: sizes + sha256 of every file
    <dir>/latest                                    "step-<N>" of the newest commit

Each rank writes its share of the name-keyed view of the state (``framework.persist.layout``);
a load reads this rank's holdings by name whatever layout the saving run had, so world size,
stage and offload may change between save and load. Modules, in the order of a run: ``_resume``
(which folder), ``_load``, ``_save``; under them ``_group`` (collectives and their errors),
``_folder`` (the commit protocol), ``_dcp`` (DCP glue, imported on first use), ``_rng``.

Integrity: a save commits only state known good. The ranks agree, before writing, that every value
is finite and that the disk has room; under offload=nvme the swapped extents are checked before
the checkpoint reads them and again after (``offload.verify_map``). Each phase of the write ends
in an exchange of outcomes (``_group.agree_save``), so one rank's failure (a full disk, a changed
swap file) ends every rank with the same line and removes the unfinished folder. A step with a
non-finite loss or gradient norm never gets here (``framework.engine.step``). A load checks files
against the manifest, train_state.json against the manifest and the loaded values for NaN/inf;
any of them refuses the checkpoint on every rank, and ``resume=auto`` falls back to the previous.

NVMe offload: the swapped state is read and written where it lies. A save maps the swap file
(``engine.mapped_state``: writes settled, every extent checked against the IO engine's
checksums) and DCP writes the swapped pieces' boxes straight from the mapped pages, no host copy
of them (``Boxes(own=...)``); such a save is always written on the training thread (an async save
would need a host copy of the whole swapped state). A load maps the new layout's swap files
writable and DCP reads the saved chunks straight into them (the fragments of swapped pieces alias
the mapping); the file is then synced and its checksums recomputed. Every pass over the mapping
(checks, finiteness, DCP's write or read, checksums) drops each range's pages from the process once
done with it (``FileMap.release``): the resident set of a save or load does not grow with the model.
The checkpoint stays keyed by parameter name: never a copied swap folder tied to one world size.
"""
from __future__ import annotations

import concurrent.futures
from pathlib import Path
from typing import Any, Callable

from framework.core.errors import CheckpointError, ConfigError
from framework.persist.checkpoint import _folder
from framework.persist.checkpoint._group import Group, glue
from framework.persist.checkpoint._load import load
from framework.persist.checkpoint._resume import candidates, changed, checkpoint_root, find_latest, preflight
from framework.persist.checkpoint._save import save

__all__ = ["Checkpointer", "CheckpointError", "LoadPlanner", "SafeReader", "checkpoint_root", "find_latest", "load",
           "preflight", "read_metadata", "save"]


def __getattr__(name: str):
    # DCP's glue only on first use: importing DCP costs most of a second (``_group.glue``).
    if name in ("LoadPlanner", "SafeReader", "read_metadata"):
        return getattr(glue(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class Checkpointer:
    """Periodic saves and the resume of one training run, as ``cfg.checkpoint`` says."""

    def __init__(self, cfg, engine, job: str | None = None, run_dir: Path | None = None,
                 on_point: Callable[[str], None] | None = None):
        """``run_dir``: the run's folder, whose ``checkpoints/`` holds its checkpoints unless
        ``checkpoint.dir`` is set (``checkpoint_root``). ``job``: the job's name within a multirun
        sweep (its overrides); under an explicit ``checkpoint.dir`` its checkpoints go to
        ``<checkpoint.dir>/<job>`` so that jobs of one sweep never resume from each other's.
        ``on_point``: called at the points of each save's protocol (``save``'s; fault tests)."""
        self.cfg = cfg.checkpoint
        self.config = cfg.to_dict()
        self.seed = cfg.seed
        self.engine = engine
        dist = engine.components.dist
        self.rank = dist.rank
        self.root = checkpoint_root(cfg, run_dir, job)
        self.on_nonfinite = cfg.train.on_nonfinite
        self.group = Group(dist.rank, dist.world, self.cfg.timeout_s, dist)
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpoint") \
            if self.cfg.async_ else None
        self._pending: concurrent.futures.Future | None = None
        self.writer = None   # DCP's storage writer, None: FileSystemWriter (tests put one that fails on purpose here)
        self.on_point = on_point

    def _say(self, msg: str) -> None:
        if self.rank == 0:
            print(f"checkpoint: {msg}", flush=True)

    def resume(self, state):
        """The state to start from: loaded from the checkpoint ``checkpoint.resume`` selects, or
        ``state`` itself (saying why). Collective."""
        resume = self.cfg.resume
        if resume == "off":
            existing = _folder.committed(self.root)
            if existing:
                self._say(f"resume=off: starting from step 0 although {self.root} holds {len(existing)} "
                          f"checkpoint(s), newest {existing[0].name}; set checkpoint.resume=auto to continue from it")
            return state
        # Rank 0 looks, every rank gets its answer (or its error: no rank is left waiting).
        choice: Any = None
        if self.rank == 0:
            try:
                choice = candidates(resume, self.root)
            except ConfigError as e:
                choice = str(e)
        choice = self.group.all_gather(choice, "resume choice")[0]
        if isinstance(choice, str):
            raise ConfigError(choice)
        folders, notes = choice
        for note in notes:   # never passed over silently
            self._say(note)
        if not folders:
            if resume == "auto" and self.cfg.every:
                self._say(f"resume=auto: no checkpoint in {self.root}; starting from step 0")
            return state
        errors = []
        for i, folder in enumerate(folders):
            try:
                state, body = load(self.engine, state, folder, group=self.group, seed=self.seed)
            except CheckpointError as e:
                if resume != "auto" and len(folders) == 1:   # the one folder asked for: no other choice
                    raise
                errors.append(str(e))
                # Every rank says it, before any training: no rank goes on from a state the others refused.
                then = (f"falling back to the previous checkpoint, {folders[i + 1]}" if i + 1 < len(folders)
                        else "no older checkpoint is left")
                print(f"rank {self.rank}: {e}; {then}", flush=True)
                continue
            if body["world"] != self.group.world:
                how = f"resharded from {body['world']} rank(s), stage {body['stage']}; RNG re-derived"
            elif body["stage"] != self.config["stage"]["name"]:
                how = f"resharded from stage {body['stage']}"
            else:
                how = "same layout"
            diff = changed(body["config"], self.config)
            self._say(f"resumed from {folder} (step {body['step']}, data position {body['data']}; {how})"
                      + (f"; config differs in {', '.join(diff[:8])}" if diff else ""))
            return state
        raise CheckpointError(f"resume={resume}: every checkpoint in {folders[0].parent} is damaged or not "
                              f"finite (the folders are kept; set checkpoint.resume=off to start afresh): "
                              + " | ".join(errors))

    def maybe_save(self, state, last: bool = False, metrics: dict | None = None) -> None:
        """Save every ``checkpoint.every`` steps and at the ``last``; ``metrics``: the step's, whose
        non-finite loss or gradient norm (``train.on_nonfinite=warn``) means no save of it."""
        every = self.cfg.every
        if every and (state.step % every == 0 or last):
            if metrics is not None and metrics.get("nonfinite"):
                self._say(f"not saving step {state.step}: its loss or gradient norm was not finite "
                          f"(train.on_nonfinite=warn); the previous checkpoints are kept")
                return
            self.save(state)

    def save(self, state) -> None:
        self.wait()
        self._pending = save(self.engine, state, self.root, group=self.group, config=self.config,
                             keep_last=self.cfg.keep_last, background=self._pool, nonfinite=self.on_nonfinite,
                             writer=self.writer, on_point=self.on_point)

    def wait(self) -> None:
        """Wait for a save in flight; its error, if any, is raised here."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            self.group.close()
