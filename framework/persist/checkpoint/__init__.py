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

Loading re-slices by name into whatever layout the loading run has (``engine.load_state_dict``),
so world size, stage and offload may change between save and load.

Integrity: a save commits only state known good. The ranks agree, before writing, that every value
is finite and that the disk has room (``_agree_to_save``); under offload=nvme the swapped extents
are checked before the checkpoint reads them and again after (``offload._verified``). Each phase of
the write ends in an exchange of outcomes (``_agree``), so one rank's failure (a full disk, a
changed swap file) ends every rank with the same line and removes the unfinished folder. A step
with a non-finite loss or gradient norm never gets here (``framework.engine.step``). A load checks files
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
import contextlib
import errno
import hashlib
import json
import math
import os
import pickle
import shutil
import signal
import sys
import time
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist

from framework.persist.checkpoint import _folder, _rng
from framework.comm.distributed import agree
from framework.core.errors import CheckpointError, ConfigError, FrameworkError, TrainingError
from framework.offload import verify_map
from framework.core.room import Claim, shortfalls
from framework.core.units import MiB, size
from framework.engine.state import FORMAT as STATE_FORMAT, dynamic_loss_scale, optimizer_leaves
from framework.persist.weights import save_on_model_save

__all__ = ["Checkpointer", "CheckpointError", "LoadPlanner", "SafeReader", "find_resumable", "load", "read_metadata", "save"]


def _glue():
    """torch.distributed.checkpoint and our glue to it (``_dcp``), imported on the first save, load
    or DCP error: importing DCP costs most of a second (DTensor, sympy), which every process of
    every run would pay at start-up, checkpointing or not."""
    from framework.persist.checkpoint import _dcp as glue
    return glue


def __getattr__(name: str):
    if name in ("LoadPlanner", "SafeReader", "read_metadata"):
        return getattr(_glue(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

TRAIN_STATE = "train_state.json"
# torch.optim's names for the per-element and scalar state of our transforms (the DCP keys).
_TORCH_NAMES = {"mu": "exp_avg", "nu": "exp_avg_sq", "trace": "momentum_buffer", "sum_of_squares": "sum",
                "count": "step"}


def fault(point: str, rank: int) -> None:
    """Test hook for the fault tests: ``FRAMEWORK_FAULT=<point>@<rank>[,stop][,once=<marker file>]``
    ends this process with ``os._exit(17)`` (as a kill would, no cleanup) when rank ``rank``
    reaches ``point``: ``save-<N>:after-shard``, ``save-<N>:before-manifest``,
    ``save-<N>:before-rename``, ``save-<N>:before-latest`` (during the save of step N) or
    ``step:<N>`` (after train step N); with ``stop`` it sends itself SIGSTOP instead (a stalled
    rank). With ``once`` it fires only if the marker file does not exist yet, and creates it.
    Unset in normal runs: nothing happens."""
    spec = os.environ.get("FRAMEWORK_FAULT")
    if not spec:
        return
    where, _, once = spec.partition(",once=")
    where, stop = where.removesuffix(",stop"), where.endswith(",stop")
    if where != f"{point}@{rank}":
        return
    if once:
        try:
            os.close(os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        except FileExistsError:
            return
    print(f"FRAMEWORK_FAULT: rank {rank} {'stops' if stop else 'exits'} at {point}", file=sys.stderr, flush=True)
    if stop:
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    os._exit(17)


def _fault(step: int, point: str, rank: int) -> None:
    fault(f"save-{step}:{point}", rank)


def config_hash(cfg: dict) -> str:
    return hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _optim_keys(per: list[str], scalars: list[str]) -> dict[str, str]:
    """Optimizer leaf path ('0.mu') -> DCP key part ('exp_avg'); the chain index is kept only
    where two leaves would get one name."""
    short = {p: _TORCH_NAMES.get(p.rsplit(".", 1)[-1], p.rsplit(".", 1)[-1]) for p in [*per, *scalars]}
    names = list(short.values())
    return {p: (n if names.count(n) == 1 else p) for p, n in short.items()}


class _Group:
    """Collectives of the checkpoint code: their own gloo group with a long timeout, so a save
    in a background thread never shares a group with training (concurrent collectives on one
    group can deadlock) and a slow file system does not trip ``dist.timeout_s``."""

    def __init__(self, rank: int, world: int, timeout_s: float, dist=None):
        """``dist``: the run's ``Dist``, to name a peer that died or stalled in a failed exchange."""
        self.rank, self.world, self.timeout_s, self.dist = rank, world, timeout_s, dist
        self.pg = (tdist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
                   if world > 1 else None)

    def all_gather(self, obj: Any, what: str) -> list:
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        try:
            tdist.all_gather_object(out, obj, group=self.pg)
        except RuntimeError as e:
            who = self.dist.who_failed() if self.dist is not None else "a peer rank died or stalled"
            raise FrameworkError(f"rank {self.rank}/{self.world}: checkpoint {what} failed after waiting up to "
                                 f"{self.timeout_s:g}s ({who}; checkpoint.timeout_s sets the "
                                 f"limit): {str(e).splitlines()[0]}") from e
        return out

    def enter(self, stack: contextlib.ExitStack, context, what: str):
        """``stack.enter_context(context)`` on every rank, agreed on (``framework.comm.distributed.agree``):
        when it fails on some rank (a damaged swap file), every rank raises at once, naming it,
        instead of the others waiting for it in the next collective."""
        entered = []
        agree(lambda obj: self.all_gather(obj, what), self.rank,
              lambda: entered.append(stack.enter_context(context)), f"checkpoint {what}")
        return entered[0]

    def dcp_kwargs(self) -> dict:
        return {"process_group": self.pg} if self.world > 1 else {"no_dist": True}

    def close(self) -> None:
        if self.pg is not None:
            tdist.destroy_process_group(self.pg)
            self.pg = None


# --- save ------------------------------------------------------------------------------------

def _subtract(lo: int, hi: int, taken: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Parts of [lo, hi) outside the ``taken`` ranges (sorted by start)."""
    out, pos = [], lo
    for a, b in taken:
        if b <= pos or a >= hi:
            continue
        if a > pos:
            out.append((pos, a))
        pos = max(pos, b)
    if pos < hi:
        out.append((pos, hi))
    return out


def _snapshot(engine, view, group: _Group, zero_copy: bool) -> dict:
    """This rank's share of ``view.state`` (an ``engine.mapped_state`` view) as DCP values
    (collective: the ranks exchange what they hold).

    A rank writes the elements it holds that no lower rank holds (replicated stages: rank 0
    writes everything once). Each rectangular box is copied to the host on its own, into a
    tensor that owns exactly its bytes: one copy of the state, and none more in DCP's writer
    (it clones any view of a larger storage before serialising it). With ``zero_copy`` (a save
    written before training goes on) boxes of a mapped swap file are not copied: DCP writes
    them from the file's pages. ``nonfinite`` names what this rank holds that is NaN or inf."""
    c = engine.components
    state = view.state
    own = view.own if zero_copy else None
    specs = c.stage.piece_specs()
    per, scalars = optimizer_leaves(state.opt_state, state.params)
    held: dict[str, dict] = {}
    for spec in specs:
        for span in spec.spans:
            held.setdefault(span.name, {"shape": list(span.shape), "ranges": []})["ranges"].append(list(span.param))
    everyone = group.all_gather(held, "layout gather")
    keys = _optim_keys(sorted(per), sorted(scalars))
    pieces: dict[str, dict[str, list]] = {}
    checked = []
    for k, spec in enumerate(specs):
        flat = {"master": state.params[k].reshape(-1), **{p: ts[k].reshape(-1) for p, ts in per.items()}}
        checked += [(spec, key, t) for key, t in flat.items()]
        for span in spec.spans:
            lower = sorted(tuple(r) for other in everyone[:group.rank]
                           for r in other.get(span.name, {}).get("ranges", ()))
            for a, b in _subtract(*span.param, lower):
                at = span.piece[0] + a - span.param[0]
                for key, t in flat.items():
                    pieces.setdefault(span.name, {}).setdefault(key, []).append(((a, b), t[at:at + b - a]))
    release = view.fmap.release if view.fmap is not None else None
    nonfinite = _nonfinite(checked, lambda key, name: f"model.{name}" if key == "master"
                           else f"optim.{keys[key]}.{name}", release)
    out: dict[str, Any] = {}
    Boxes = _glue().Boxes
    for name, by_key in pieces.items():
        shape = held[name]["shape"]
        for key, ps in by_key.items():
            out[f"model.{name}" if key == "master" else f"optim.{keys[key]}.{name}"] = Boxes(shape, ps, copy=True,
                                                                                             own=own)
    host_scalars = {p: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v
                    for p, v in scalars.items()}
    for path, value in host_scalars.items():  # the same on every rank: DCP writes it once
        out[f"optim.{keys[path]}"] = torch.as_tensor(value).clone()
    nbytes = sum(t.numel() * t.element_size() for v in out.values()
                 for t in (v.tensors() if isinstance(v, Boxes) else [v]))
    return {"dcp": out, "everyone": everyone, "per": sorted(per), "scalars": host_scalars, "keys": keys,
            "step": state.step, "data": state.data, "precision": asdict(state.precision),
            "dynamic_loss_scale": dynamic_loss_scale(c.policy), "applied": state.applied_steps,
            "nonfinite": nonfinite, "bytes": nbytes, "items": len(out),
            "release": release if zero_copy else None}


def _finite_flags(tensors: list[torch.Tensor], release=None) -> list[bool]:
    """Whether each tensor is free of NaN and inf: min and max propagate both, so one small
    reduction per tensor where it lives and one sync for all of them. ``release(t)``: called
    after each tensor's reduction (a mapped swap file's pages leave the process one by one)."""
    flags: list[bool] = [True] * len(tensors)
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)

    def reduced(t: torch.Tensor) -> torch.Tensor:
        out = torch.isfinite(torch.stack(t.aminmax())).all()
        if release is not None:
            release(t)
        return out

    for idx in by_device.values():
        ok = torch.stack([reduced(tensors[i]) for i in idx])
        for i, good in zip(idx, ok.cpu().tolist()):   # sync point: once per device, per save or load
            flags[i] = good
    return flags


def _floats(t: torch.Tensor) -> bool:
    return t.numel() > 0 and t.is_floating_point()


def _nonfinite_items(items: list[tuple[str, torch.Tensor]], release=None) -> list[str]:
    """The names among ``items`` ((name, tensor)) whose tensor holds a NaN or an infinity."""
    items = [(n, t) for n, t in items if _floats(t)]
    return sorted({n for (n, _), ok in zip(items, _finite_flags([t for _, t in items], release)) if not ok})


def _nonfinite(checked: list, label, release=None) -> list[str]:
    """Names (``label(key, parameter)``) of the values in ``checked`` ((spec, key, flat tensor) of
    each piece) that hold a NaN or an infinity; the parameters inside a piece are only looked at
    when the piece has one."""
    checked = [(spec, key, t) for spec, key, t in checked if _floats(t)]
    bad = [x for x, ok in zip(checked, _finite_flags([t for _, _, t in checked], release)) if not ok]
    return _nonfinite_items([(label(key, span.name), t[span.piece[0]:span.piece[1]])
                             for spec, key, t in bad for span in spec.spans])


def _room_claim(root: Path, snap: dict, rank: int) -> Claim:
    """What this rank's files of the checkpoint will take in ``root`` (tensor bytes, with some room
    for DCP's per-item records, the JSON files and the metadata)."""
    return Claim.of(root, snap["bytes"] + 4096 * snap["items"] + (64 << 10), rank)


def save(engine, state, root: Path, *, group: _Group, config: dict, keep_last: int,
         background: concurrent.futures.Executor | None = None, nonfinite: str = "stop",
         writer: type | None = None):
    """Save ``state`` as ``root/step-<state.step>`` (collective). The host copy of this rank's
    state is taken before returning; with ``background`` the files are written there and its
    future is returned (None otherwise).

    Committed only from state known good (every rank agrees before anything is written): finite
    (else ``TrainingError``, or with ``nonfinite="warn"`` a warning and no save), and under
    offload=nvme every swapped extent checked against the IO engine's checksums both before the
    bytes are read for the checkpoint (``engine.mapped_state``) and after (``verify_map``): a swap
    file changed meanwhile is caught before the commit, never saved. Room on the disk is checked
    for all ranks sharing it before writing (one line naming the folder and the bytes).
    ``writer``: DCP's storage writer class (a seam for tests: one that fails or races on purpose;
    None: ``FileSystemWriter``)."""
    staged16 = None
    if engine.components.stage.weights_on_save():
        # stage3_gather_16bit_weights_on_model_save: this step's working-dtype weights as
        # consolidated safetensors, written now on the training thread (collective on the default
        # group, each rank its own ranges) into a staging folder that ``_write`` moves into the
        # step folder as model_16bit/, so they are committed, pruned and found with the step.
        if group.rank == 0:
            _folder.mkdir_private(root)
        staged16 = root / f"step-{state.step}.model_16bit"
        save_on_model_save(engine, staged16)
    rng = _rng.capture(state.rng)
    meta = {"stage": config.get("stage", {}).get("name"), "offload": config.get("offload", {}).get("name"),
            "precision_policy": config.get("precision", {}).get("name")}
    with contextlib.ExitStack() as stack:   # offload=nvme: the swap file, mapped and checked
        view = group.enter(stack, engine.mapped_state(state), "swap file check")
        if view.fmap is not None:
            # A swapped state is written from the swap file's pages, page range by page range, on
            # this thread: a background save would need a host copy of all of it (model-sized).
            background = None
        snap = _snapshot(engine, view, group, zero_copy=background is None)
        recheck = lambda: verify_map(view.fmap, "checked again after the checkpoint read it")  # noqa: E731
        if not _agree_to_save(snap, root, group, nonfinite, staged16, recheck):
            return None
        if background is None:
            # inside the block: DCP reads the mapped pages before training changes them
            _write(snap, rng, root, group=group, config=config, keep_last=keep_last, meta=meta,
                   staged16=staged16, recheck=recheck, writer=writer)
            return None
        _agree(group, "swap file check after the host copy", recheck, root / f"step-{state.step}.tmp", cleanup=False)
    return background.submit(_write, snap, rng, root, group=group, config=config, keep_last=keep_last, meta=meta,
                             staged16=staged16, writer=writer)


def _agree_to_save(snap: dict, root: Path, group: _Group, nonfinite: str, staged16: Path | None,
                   recheck) -> bool:
    """Every rank's verdict on the state (finite) and on the room for it, exchanged; True to save.
    Non-finite state raises TrainingError on every rank (``nonfinite="warn"``: says so and returns
    False), unless the swap file changed under it (``recheck`` fails: that error is the cause); too
    little room raises CheckpointError naming the folder and the bytes needed."""
    step = snap["step"]
    problem, claim = None, None
    try:
        claim = _room_claim(root, snap, group.rank)
        if snap["nonfinite"]:
            recheck()
    except OSError as e:
        problem = f"rank {group.rank}: cannot inspect {root} ({e.strerror or e})"
    except FrameworkError as e:
        problem = f"rank {group.rank}: {e}"
    everyone = group.all_gather((snap["nonfinite"], claim, problem), "pre-save check")
    bad = [f"rank {r}: {_few(names)}" for r, (names, _, _) in enumerate(everyone) if names]
    refused = None
    if bad:
        refused = (f"checkpoint: not saving step {step}: the state holds non-finite values (NaN or inf) in "
                   f"{'; '.join(bad)}")
    problems = [p for _, _, p in everyone if p]
    shorts = shortfalls([c for _, c, _ in everyone if c is not None]) if not problems else []
    if (refused or problems or shorts) and group.rank == 0 and staged16 is not None:
        shutil.rmtree(staged16, ignore_errors=True)
    if problems:
        raise CheckpointError(f"checkpoint: not saving step {step}: {problems[0]}; the previous checkpoints are kept")
    if refused and nonfinite == "warn":
        if group.rank == 0:
            print(f"warning: {refused} (train.on_nonfinite=warn)", file=sys.stderr, flush=True)
        return False
    if refused:
        raise TrainingError(f"{refused}; stopping (the previous checkpoints are kept). Lower the learning rate or "
                            f"check the data; train.on_nonfinite=warn keeps training without saving such state")
    if shorts:
        raise CheckpointError(f"checkpoint: not saving step {step}: " + "; ".join(
            s.describe("the checkpoint files") for s in shorts)
            + "; free space, lower checkpoint.keep_last or set checkpoint.dir to a larger disk "
              "(the previous checkpoints are kept)")
    return True


def _agree(group: _Group, what: str, fn, tmp: Path, *, cleanup: bool = True, need: int = 0) -> list:
    """``fn()`` on every rank, outcomes exchanged (the exchange is also a barrier); returns every
    rank's result. When it failed anywhere, rank 0 removes the unfinished ``tmp`` folder
    (``cleanup``) and every rank raises one CheckpointError naming the rank, the file and the
    cause, so the previous checkpoints stay as they were and no rank waits for another that gave
    up. ``need``: the checkpoint's bytes, for the message of a full disk."""
    result, problem = None, None
    try:
        result = fn()
    except (Exception, _glue().CheckpointException) as e:   # noqa: BLE001 - DCP's exception is a BaseException
        # DCP raises on every rank what failed on some: named after the ranks that failed
        ranks = sorted(e.failures) if isinstance(e, _glue().CheckpointException) and e.failures else [group.rank]
        problem = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {_write_error(e, tmp, need)}"
    everyone = group.all_gather((result, problem), what)
    problems = list(dict.fromkeys(p for _, p in everyone if p))
    if problems:
        if cleanup and group.rank == 0 and not tmp.is_symlink():   # (a planted link is only named)
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"checkpoint: saving {tmp.name.removesuffix('.tmp')} failed ({what}): {problems[0]}"
                              + (f" (and {len(problems) - 1} more rank(s))" if len(problems) > 1 else "")
                              + "; the previous checkpoints are kept")
    return [r for r, _ in everyone]


def _write_error(e: BaseException, tmp: Path, need: int) -> str:
    """One line for a failed write: a full disk names the folder, the free and the needed bytes
    (torch's zip writer reports ENOSPC as "unexpected pos", DCP wraps it per rank)."""
    causes = _causes(e)
    full = any(isinstance(c, OSError) and c.errno in (errno.ENOSPC, errno.EDQUOT) for c in causes) or any(
        "unexpected pos" in str(c) or "No space left" in str(c) for c in causes)
    if full:
        try:
            free = f"{size(Claim.of(tmp.parent, 0).free)} free"
        except OSError:
            free = "free space unknown"
        return (f"the file system of {tmp.parent} is full ({free}; the checkpoint needs about {size(need)}): "
                f"free space, lower checkpoint.keep_last or set checkpoint.dir to a larger disk")
    return _describe(e)


def _describe(e: BaseException) -> str:
    """One line for an error, DCP's per-rank wrapping unpacked: its first real cause."""
    exc = _glue().CheckpointException
    first = next((c for c in _causes(e) if not isinstance(c, exc)), e)
    text = " ".join(str(first).split()) or type(first).__name__
    if isinstance(first, FrameworkError):
        return text[:500]
    where = f" ({first.filename})" if isinstance(first, OSError) and first.filename else ""
    return f"{type(first).__name__}{where}: {text[:400]}"


def _causes(e: BaseException) -> list[BaseException]:
    """``e``, the per-rank failures DCP wrapped in it and their chained causes."""
    out, todo, exc = [], [e], _glue().CheckpointException
    while todo:
        c = todo.pop()
        if c is None or any(c is x for x in out):
            continue
        out.append(c)
        if isinstance(c, exc):
            todo += [pair[0] for pair in c.failures.values()]
        todo += [c.__cause__, c.__context__]
    return out


def _write(snap: dict, rng: dict, root: Path, *, group: _Group, config: dict, keep_last: int, meta: dict,
           staged16: Path | None = None, recheck=None, writer: type | None = None) -> Path:
    """Write and commit the snapshot (collective). Each phase ends in an exchange of outcomes
    (``_agree``): a failure anywhere removes the unfinished folder and raises on every rank.
    ``recheck``: run after the files are written, before the commit (the swap file's extents
    checked again: what DCP read from its pages was what was checked)."""
    t0 = time.perf_counter()
    step, rank = snap["step"], group.rank
    tmp, final = root / f"step-{step}.tmp", root / f"step-{step}"
    need = _room_claim(root, snap, rank).need * group.world

    def make_folder():
        if rank == 0:
            _folder.mkdir_private(root)
            _folder.remove_stale(root, keep=staged16)
            _folder.make_step_folder(tmp)
            if staged16 is not None:   # a subfolder: beside the manifest's files, moved and pruned with them
                os.replace(staged16, tmp / "model_16bit")

    _agree(group, "making the folder", make_folder, tmp)   # the folder exists before any rank writes

    def write_files():
        glue = _glue()
        glue.dcp.save(snap["dcp"], storage_writer=(writer or glue.dcp.FileSystemWriter)(tmp, sync_files=True),
                      planner=glue.SavePlanner(snap.get("release")), **group.dcp_kwargs())
        _folder.write_private(tmp / f"rng-{rank}.json", json.dumps(rng).encode())
        _fault(step, "after-shard", rank)
        if rank == 0:
            everyone = snap["everyone"]
            body = {"format": 1, "state_format": STATE_FORMAT, "step": step, "data": snap["data"],
                    "scheduler_position": snap["applied"], "precision": snap["precision"],
                    "dynamic_loss_scale": snap["dynamic_loss_scale"],
                    "optimizer": {"per_element": snap["per"],
                                  "scalars": {p: _json_scalar(v) for p, v in snap["scalars"].items()},
                                  "keys": snap["keys"]},
                    "world": group.world, **meta, "config": config, "config_hash": config_hash(config),
                    # The saving layout: each parameter's shape and the flat ranges each rank held.
                    "parameters": {n: e["shape"] for held in everyone for n, e in held.items()},
                    "fragments": [{n: e["ranges"] for n, e in held.items()} for held in everyone]}
            _folder.write_private(tmp / TRAIN_STATE, json.dumps(body).encode())
        if recheck is not None:
            recheck()

    _agree(group, "writing the files", write_files, tmp, need=need)
    # Checksums: each rank hashes every world-th file, so the reading is spread over the ranks.
    parts = _agree(group, "checksums", lambda: {n: _folder.file_entry(tmp, n)
                                                for n in _folder.files_of(tmp)[rank::group.world]}, tmp)

    def commit():
        if rank != 0:
            return []
        files = {k: v for part in parts for k, v in part.items()}
        _fault(step, "before-manifest", rank)
        _folder.write_manifest(tmp, files, step=step, world=group.world, stage=meta["stage"],
                               config_hash=config_hash(config), verified=True)
        _folder.commit(tmp, final, lambda point: _fault(step, point, rank))
        gone = _folder.prune(root, final, keep_last)
        total = sum(v["bytes"] for v in files.values())
        print(f"checkpoint: saved {final} ({total / MiB:.1f} MiB in {time.perf_counter() - t0:.2f}s"
              + (f"; deleted {', '.join(p.name for p in gone)}" if gone else "") + ")", flush=True)

    _agree(group, "commit", commit, tmp, need=need)
    return final


def _json_scalar(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return {"tensor": v.tolist(), "dtype": str(v.dtype).removeprefix("torch.")}
    return v


def _from_json_scalar(v: Any) -> Any:
    if isinstance(v, dict) and "tensor" in v:
        return torch.tensor(v["tensor"], dtype=getattr(torch, v["dtype"]), device="cpu")
    return v


# --- load ------------------------------------------------------------------------------------

def verify(folder: Path, group: _Group) -> dict:
    """Check every file against the manifest (each rank a share of them); every rank raises the
    same CheckpointError naming the bad files. Returns the manifest."""
    manifest = None
    try:
        manifest = _folder.read_manifest(folder)
        files = sorted(manifest["files"])
        mine = [_folder.check_file(folder, n, manifest["files"][n]) for n in files[group.rank::group.world]]
        problems = [p for p in mine if p]
    except (CheckpointError, OSError) as e:
        problems = [str(e)]
    everyone = group.all_gather(problems, "checksum verification")
    bad = sorted({p for part in everyone for p in part})
    if bad:
        raise CheckpointError(f"checkpoint {folder} is damaged: " + "; ".join(bad))
    return manifest


def _agree_load(group: _Group, what: str, fn):
    """``fn()`` on every rank, outcomes exchanged before anyone goes on (no rank waits in a later
    collective for one that gave up): a rank that failed raises its own error, the others the same
    kind (ConfigError: the checkpoint is another run's, no fallback; otherwise CheckpointError)."""
    result, problem = None, None
    try:
        result = fn()
    except FrameworkError as e:
        problem = (type(e) is ConfigError, str(e))
        mine = e
    except (Exception, _glue().CheckpointException) as e:   # noqa: BLE001 - DCP's exception is a BaseException
        problem = (False, f"{what}: {_describe(e)}")
        mine = CheckpointError(problem[1])
    problems = [p for p in group.all_gather(problem, what) if p]
    if problem is not None:
        raise mine
    if problems:
        config, text = problems[0]
        raise (ConfigError if config else CheckpointError)(text)
    return result


_BODY_KEYS = ("state_format", "step", "data", "precision", "dynamic_loss_scale", "optimizer", "world", "stage",
              "config", "parameters", "fragments")


def _train_state(folder: Path, manifest: dict) -> dict:
    """train_state.json, checked against the manifest (the world size, step and per-rank files it
    implies): a file edited or mixed from another save is refused by name."""
    path = folder / TRAIN_STATE
    body = _folder.read_json(path, "the train state")
    missing = [k for k in _BODY_KEYS if k not in body] if isinstance(body, dict) else list(_BODY_KEYS)
    if missing:
        raise CheckpointError(f"checkpoint {folder}: {path} lacks {_few(missing)}")
    world = body["world"]
    if not isinstance(world, int) or world < 1 or world != manifest.get("world"):
        raise CheckpointError(f"checkpoint {folder}: {path} says world size {world!r} but {_folder.MANIFEST} says "
                              f"{manifest.get('world')!r} (edited, or files of different saves)")
    if body["step"] != manifest.get("step") or not isinstance(body["fragments"], list) \
            or len(body["fragments"]) != world:
        raise CheckpointError(f"checkpoint {folder}: {path} does not match {_folder.MANIFEST} (step {body['step']!r} "
                              f"vs {manifest.get('step')!r}, {len(body['fragments'])} rank layouts for world {world})")
    absent = [f"rng-{r}.json" for r in range(world) if f"rng-{r}.json" not in manifest["files"]]
    if absent:
        raise CheckpointError(f"checkpoint {folder}: {_folder.MANIFEST} lists no {_few(absent)} for world size {world}")
    scale = body["precision"].get("cur_scale") if isinstance(body["precision"], dict) else None
    if not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise CheckpointError(f"checkpoint {folder}: {path} holds the loss scale {scale!r} (not a positive finite "
                              f"number)")
    return body


def load(engine, state, folder: Path, *, group: _Group, seed: int):
    """Load ``folder`` into ``state`` under this engine's layout (collective); return
    (state, train_state dict). Files are verified against the manifest first, the train state
    against the manifest, and the loaded values must be finite: a damaged or non-finite
    checkpoint raises CheckpointError on every rank (``resume=auto`` then falls back)."""
    manifest = verify(folder, group)
    c = engine.components
    per, scalars = optimizer_leaves(state.opt_state, state.params)
    specs = c.stage.piece_specs()

    def check():
        body = _train_state(folder, manifest)
        md = _glue().read_metadata(folder / ".metadata")
        _fits(c, folder, body, md, specs, per, scalars)
        return body, md

    body, md = _agree_load(group, f"checkpoint check of {folder}", check)
    keys = body["optimizer"]["keys"]
    saved = {k[len("model."):]: tuple(v.size) for k, v in md.state_dict_metadata.items() if k.startswith("model.")}
    with contextlib.ExitStack() as stack:   # offload=nvme: the new layout's swap files, mapped writable
        view = group.enter(stack, engine.mapped_state(state, write=True), "swap file mapping")
        fragments = _targets(view, specs, per, saved)
        release = view.fmap.release if view.fmap is not None else None   # pages leave as they are filled
        targets: dict[str, Any] = {}
        glue = _glue()
        for name, entry in fragments.items():
            frags = entry["fragments"]
            targets[f"model.{name}"] = glue.Boxes(saved[name], [(f["range"], f["master"]) for f in frags])
            for p in per:
                targets[f"optim.{keys[p]}.{name}"] = glue.Boxes(saved[name], [(f["range"], f["optim"][p]) for f in frags])

        def read():
            try:
                glue.dcp.load(targets, storage_reader=glue.SafeReader(folder, md), planner=glue.LoadPlanner(release),
                         **group.dcp_kwargs())
            except FrameworkError:
                raise
            except (Exception, _glue().CheckpointException) as e:   # noqa: BLE001 - DCP wraps per-rank failures
                # (a shard torch refuses to unpickle with weights_only ends here: a BaseException)
                if any(isinstance(c, pickle.UnpicklingError) for c in _causes(e)):
                    where = glue.unpicklable(folder, md) or f"a DCP file in {folder}"
                    raise CheckpointError(f"checkpoint {folder}: {where}: torch refuses to unpickle it with "
                                          f"weights_only=True (not plain tensor data: a crafted or foreign file); "
                                          f"it is never loaded") from None
                raise CheckpointError(f"checkpoint {folder}: reading the DCP files failed: {_describe(e)}") from None
            bad = _nonfinite_items([(f"model.{n}", f["master"]) for n, e in fragments.items() for f in e["fragments"]]
                                   + [(f"optim.{keys[p]}.{n}", f["optim"][p]) for n, e in fragments.items()
                                      for f in e["fragments"] for p in per], release)
            if bad:
                raise CheckpointError(f"checkpoint {folder}: non-finite values (NaN or inf) in {_few(bad)} "
                                      f"(rank {group.rank}'s share): not a state to train from")
            return _load_fragments(engine, view, folder, body, fragments, seed)

        loaded, host_rng = _agree_load(group, f"reading {folder}", read)
    state = engine.finish_load(state, loaded)
    _rng.restore_host(host_rng)
    return state, body


def _fits(c, folder: Path, body: dict, md, specs, per: dict, scalars: dict) -> None:
    """ConfigError when the checkpoint is of another model or optimizer (the user chooses: no
    fallback); CheckpointError when its files lack what its train state names."""
    opt = body["optimizer"]
    if set(per) != set(opt["per_element"]) or set(scalars) != set(opt["scalars"]):
        raise ConfigError(f"checkpoint {folder} holds the optimizer state "
                          f"{sorted([*opt['per_element'], *opt['scalars']])} but this "
                          f"optimizer's is {sorted([*per, *scalars])}; resume with the optimizer it was saved with"
                          f"{_OTHER_RUN}")
    saved = {k[len("model."):]: tuple(v.size) for k, v in md.state_dict_metadata.items() if k.startswith("model.")}
    names = [n for n, p in c.module.named_parameters() if p.requires_grad]
    missing, extra = sorted(set(names) - set(saved)), sorted(set(saved) - set(names))
    if missing or extra:
        raise ConfigError(f"checkpoint {folder} does not fit this model: "
                          + "; ".join(x for x in (f"missing parameters {_few(missing)}" if missing else "",
                                                  f"unexpected parameters {_few(extra)}" if extra else "") if x)
                          + _OTHER_RUN)
    for spec in specs:
        for span in spec.spans:
            if tuple(span.shape) != saved[span.name]:
                raise ConfigError(f"checkpoint {folder}: parameter {span.name!r} has shape {saved[span.name]} "
                                  f"in the checkpoint but {tuple(span.shape)} in this model{_OTHER_RUN}")
    keys = opt["keys"]
    wanted = {f"model.{span.name}" for spec in specs for span in spec.spans}
    wanted |= {f"optim.{keys[p]}.{k[len('model.'):]}" for k in wanted for p in per}
    absent = sorted(wanted - set(md.state_dict_metadata))
    if absent:
        raise CheckpointError(f"checkpoint {folder}: the DCP files lack {_few(absent)}")


def _targets(view, specs, per: dict, saved: dict) -> dict[str, dict]:
    """Where DCP reads each span of each master piece: per parameter, fragments (``framework.
    state.state_dict``'s format) that are views of the piece itself when it lies in a mapped swap
    file (read straight into the file), else fresh flat host buffers."""
    state = view.state
    views = {"master": state.params, **optimizer_leaves(state.opt_state, state.params)[0]}
    fragments: dict[str, dict] = {}
    for k, spec in enumerate(specs):
        mapped = view.maps(state.params[k])
        for span in spec.spans:
            (a, b), (lo, hi) = span.piece, span.param
            bufs = {key: views[key][k].reshape(-1)[a:b] if mapped else torch.empty(hi - lo, device="cpu")
                    for key in ("master", *per)}
            master = bufs.pop("master")
            fragments.setdefault(span.name, {"shape": saved[span.name], "fragments": []})["fragments"].append(
                {"range": span.param, "master": master, "optim": bufs})
    return fragments


def _load_fragments(engine, view, folder: Path, body: dict, fragments: dict, seed: int):
    """(loaded state, host RNG states): ``fragments`` (read from ``folder``) and ``body`` (its train
    state) loaded into ``view`` by ``engine.load_into``, with the RNG resumed or re-derived."""
    c = engine.components
    rank, world = c.dist.rank, c.dist.world
    # Same world size: each rank resumes its own generators; otherwise they are re-derived.
    if body["world"] == world:
        saved_rng = _folder.read_json(folder / f"rng-{rank}.json", "random generator states")
        try:
            torch_rng, host_rng = _rng.torch_states(saved_rng), saved_rng
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"checkpoint {folder}: rng-{rank}.json holds no valid generator states "
                                  f"({e})") from None
    else:
        torch_rng, host_rng = _rng.derive(seed, body["step"], rank, c.dist.device)
    pseudo = {"format": body["state_format"], "rank": rank, "world": world, "step": body["step"],
              "data": body["data"], "precision": body["precision"],
              "dynamic_loss_scale": body["dynamic_loss_scale"], "rng": list(torch_rng),
              "optimizer": {"per_element": body["optimizer"]["per_element"],
                            "scalars": {p: _from_json_scalar(v) for p, v in body["optimizer"]["scalars"].items()}},
              "params": fragments}
    return engine.load_into(view, [pseudo]), host_rng


# A checkpoint of another model or optimizer is not damaged: no fallback, the user chooses.
_OTHER_RUN = "; use another checkpoint.dir or checkpoint.resume=off to start this run afresh"


def _few(items: list[str]) -> str:
    return ", ".join(map(repr, items[:5])) + (f" and {len(items) - 5} more" if len(items) > 5 else "")


def checkpoint_root(cfg, run_dir: Path | None, job: str | None = None) -> Path:
    """Where a run's checkpoints go: ``checkpoint.dir``, else ``checkpoints/`` in the run folder
    (so a run never meets another run's checkpoints unless pointed at them), else (library use
    without a run folder) ``checkpoints/`` in the working directory. Under an explicit
    ``checkpoint.dir`` each multirun job gets ``<dir>/<its overrides>``."""
    c = cfg.checkpoint
    if c.dir is None:
        return (Path(run_dir) if run_dir is not None else Path.cwd()).resolve() / "checkpoints"
    root = Path(c.dir).expanduser().resolve()
    return root / _job_folder(job) if job else root


# Where ``checkpoint.resume=latest`` looks besides the run's own folder: run folders of Hydra's
# default layout under the working directory (outputs/<date>/<time>, multirun/<date>/<time>/<job>)
# or any folder one to three levels below them.
_RUN_TREES = ("outputs", "multirun")


def find_latest(root: Path, cwd: Path | None = None) -> Path | None:
    """The newest committed checkpoint (by commit time) in ``root`` and in the ``checkpoints``
    folders of the run folders under ``outputs/`` and ``multirun/``; None if there is none."""
    cwd = cwd or Path.cwd()
    roots = {root}
    for tree in _RUN_TREES:
        for depth in ("*", "*/*", "*/*/*"):
            roots.update(p for p in (cwd / tree).glob(f"{depth}/checkpoints") if p.is_dir() and not p.is_symlink())
    best: tuple[float, Path] | None = None
    for r in roots:
        found = _folder.committed(r)
        if found:
            t = (found[0] / _folder.MANIFEST).stat().st_mtime
            if best is None or t > best[0]:
                best = (t, found[0])
    return best[1] if best else None


# Model keys that may change between a save and a resume: how the same weights are computed.
_MODEL_FREE = {"activation_checkpointing", "attn_implementation", "dropout", "pretrained"}


def preflight(cfg, run_dir: Path | None, job: str | None = None, quiet: bool = False):
    """Before any rank starts: the checkpoint ``checkpoint.resume`` selects (``latest`` resolved to
    its path, so every rank loads the same), refused on one line when it was saved by another model
    or optimizer (which no rank could load); returns ``cfg`` with ``latest`` resolved. A damaged
    or unreadable candidate is left to the ranks (they fall back and say so)."""
    import dataclasses

    c = cfg.checkpoint
    root = checkpoint_root(cfg, run_dir, job)
    if c.resume == "off":
        return cfg
    if c.resume == "latest":
        folder = find_latest(root)
        if folder is None:
            quiet or print(f"checkpoint: resume=latest: no checkpoint in {root} or in the run folders under "
                  f"{', '.join(t + '/' for t in _RUN_TREES)}; starting from step 0", flush=True)
            return dataclasses.replace(cfg, checkpoint=dataclasses.replace(c, resume="off"))
        cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(c, resume=str(folder)))
        candidates = [folder]
    else:
        candidates = _candidates(c.resume, root)[0]
    if not candidates:
        return cfg
    folder = candidates[0]
    try:
        saved = json.loads((folder / TRAIN_STATE).read_text())["config"]
    except (OSError, ValueError, KeyError, TypeError):
        return cfg
    mine = cfg.to_dict()
    diffs = [k for k in _changed(saved.get("model", {}), mine["model"]) if k not in _MODEL_FREE]
    if diffs:
        what = ", ".join(f"model.{k} {_flat_get(saved['model'], k)!r} vs {_flat_get(mine['model'], k)!r}"
                         for k in diffs[:4])
        raise ConfigError(f"checkpoint.resume={c.resume}: {folder} was saved by another model ({what}; saved vs "
                          f"this run){_OTHER_RUN}")
    theirs = saved.get("optimizer", {}).get("name")
    if theirs is not None and theirs != mine["optimizer"]["name"]:
        raise ConfigError(f"checkpoint.resume={c.resume}: {folder} was saved with optimizer={theirs}, this run uses "
                          f"optimizer={mine['optimizer']['name']}; resume with optimizer={theirs}{_OTHER_RUN}")
    return cfg


def _flat_get(node: dict, dotted: str):
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def find_resumable(resume: str, root: Path) -> list[Path]:
    """Candidate folders for ``checkpoint.resume``, best first: for ``auto`` every committed
    checkpoint under ``root``, newest first (a damaged one falls back to the next); for a
    path, that step folder, or the committed checkpoints of that directory."""
    return _candidates(resume, root)[0]


def _candidates(resume: str, root: Path) -> tuple[list[Path], list[str]]:
    """(``find_resumable``'s folders, one line per ``step-<N>`` folder passed over: no manifest,
    an unreadable one, a link)."""
    if resume == "off":
        return [], []
    if resume == "auto":
        return _folder.scan(root)
    path = Path(resume).expanduser()
    if (path / _folder.MANIFEST).is_file() or (path / TRAIN_STATE).exists():
        return [path], []
    if path.is_dir():
        found, notes = _folder.scan(path)
        if found:
            return found, notes
    raise ConfigError(f"checkpoint.resume={resume}: no checkpoint there (expected a step-<N> folder with "
                      f"{_folder.MANIFEST}, or a directory holding them); use checkpoint.resume=auto or off")


class Checkpointer:
    """Periodic saves and the resume of one training run, as ``cfg.checkpoint`` says."""

    def __init__(self, cfg, engine, job: str | None = None, run_dir: Path | None = None):
        """``run_dir``: the run's folder, whose ``checkpoints/`` holds its checkpoints unless
        ``checkpoint.dir`` is set (``checkpoint_root``). ``job``: the job's name within a multirun
        sweep (its overrides); under an explicit ``checkpoint.dir`` its checkpoints go to
        ``<checkpoint.dir>/<job>`` so that jobs of one sweep never resume from each other's."""
        self.cfg = cfg.checkpoint
        self.config = cfg.to_dict()
        self.seed = cfg.seed
        self.engine = engine
        dist = engine.components.dist
        self.rank = dist.rank
        self.root = checkpoint_root(cfg, run_dir, job)
        self.on_nonfinite = cfg.train.on_nonfinite
        self.group = _Group(dist.rank, dist.world, self.cfg.timeout_s, dist)
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpoint") \
            if self.cfg.async_ else None
        self._pending: concurrent.futures.Future | None = None
        self.writer = None   # DCP's storage writer, None: FileSystemWriter (tests put one that fails on purpose here)

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
                choice = _candidates(resume, self.root)
            except ConfigError as e:
                choice = str(e)
        choice = self.group.all_gather(choice, "resume choice")[0]
        if isinstance(choice, str):
            raise ConfigError(choice)
        candidates, notes = choice
        for note in notes:   # never passed over silently
            self._say(note)
        if not candidates:
            if resume == "auto" and self.cfg.every:
                self._say(f"resume=auto: no checkpoint in {self.root}; starting from step 0")
            return state
        errors = []
        for i, folder in enumerate(candidates):
            try:
                state, body = load(self.engine, state, folder, group=self.group, seed=self.seed)
            except CheckpointError as e:
                if resume != "auto" and len(candidates) == 1:   # the one folder asked for: no other choice
                    raise
                errors.append(str(e))
                # Every rank says it, before any training: no rank goes on from a state the others refused.
                then = (f"falling back to the previous checkpoint, {candidates[i + 1]}" if i + 1 < len(candidates)
                        else "no older checkpoint is left")
                print(f"rank {self.rank}: {e}; {then}", flush=True)
                continue
            if body["world"] != self.group.world:
                how = f"resharded from {body['world']} rank(s), stage {body['stage']}; RNG re-derived"
            elif body["stage"] != self.config["stage"]["name"]:
                how = f"resharded from stage {body['stage']}"
            else:
                how = "same layout"
            changed = _changed(body["config"], self.config)
            self._say(f"resumed from {folder} (step {body['step']}, data position {body['data']}; {how})"
                      + (f"; config differs in {', '.join(changed[:8])}" if changed else ""))
            return state
        raise CheckpointError(f"resume={resume}: every checkpoint in {candidates[0].parent} is damaged or not "
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
                             writer=self.writer)

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


def _job_folder(job: str) -> str:
    """A folder name for a multirun job (its overrides): readable, short enough for any file system."""
    name = job.replace("/", "_")
    if len(name) > 120:
        name = f"{name[:100]}-{hashlib.sha256(job.encode()).hexdigest()[:12]}"
    return name


def _changed(a: dict, b: dict, prefix: str = "") -> list[str]:
    out = []
    for k in sorted(set(a) | set(b)):
        x, y = a.get(k), b.get(k)
        if isinstance(x, dict) and isinstance(y, dict):
            out += _changed(x, y, f"{prefix}{k}.")
        elif x != y and not (prefix == "checkpoint." or f"{prefix}{k}" == "dist.nproc"):
            out.append(f"{prefix}{k}")
    return out
