"""Writing a checkpoint: each rank's share of the state as DCP boxes, the ranks' agreement that it
is finite and fits on the disk, then the files, the checksums and the commit."""
from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from framework.core import files
from framework.core.errors import CheckpointError, FrameworkError, TrainingError, on_every_rank
from framework.core.paths import REPO_ROOT
from framework.core.room import Claim, shortfalls
from framework.core.units import MiB
from framework.engine.state import FORMAT as STATE_FORMAT
from framework.models.hf import architecture
from framework.offload import verify_map
from framework.persist import rng, stepfolders
from framework.persist.checkpoint._group import Group, agree_save, glue, room_fixes
from framework.persist.checkpoint._lock import LockTaken
from framework.core.utils import dtype_name, few, tensor_bytes
from framework.persist.layout import StateLayout, host_copy, nonfinite_items, pieces
from framework.persist.tensorfiles import bits_sum, read_per_device
from framework.persist.weights import save_on_model_save, tied_names, whole_tensors


def _version() -> str | None:
    """The framework's version, recorded in train_state.json (a later version's refusal can name it). The checkout's
    pyproject.toml first: a checkout run by PYTHONPATH has no package metadata, or another install's; else the
    installed package's metadata (a wheel); None where neither says (Python 3.10 has no tomllib)."""
    try:
        import tomllib

        project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text()).get("project", {})
    except (ImportError, OSError, ValueError):   # (no tomllib, no file, not TOML)
        project = {}
    if project.get("name") == "framework" and isinstance(project.get("version"), str):
        return project["version"]
    try:
        return importlib.metadata.version("framework")
    except importlib.metadata.PackageNotFoundError:
        return None


VERSION = _version()

# torch.optim's names for the per-element and scalar state of our transforms (the DCP keys).
_TORCH_NAMES = {"mu": "exp_avg", "nu": "exp_avg_sq", "trace": "momentum_buffer", "sum_of_squares": "sum",
                "count": "step"}


def optim_keys(per: list[str], scalars: list[str]) -> dict[str, str]:
    """Optimizer leaf path ('0.mu') -> DCP key part ('exp_avg'), the index kept where two leaves share a name."""
    short = {p: _TORCH_NAMES.get(p.rsplit(".", 1)[-1], p.rsplit(".", 1)[-1]) for p in [*per, *scalars]}
    names = list(short.values())
    return {p: (n if names.count(n) == 1 else p) for p, n in short.items()}


def dcp_key(key: str, name: str, keys: dict[str, str]) -> str:
    """The DCP key of a parameter's masters (``key`` 'master') or optimizer state ``key`` (a leaf path)."""
    return f"model.{name}" if key == "master" else f"optim.{keys[key]}.{name}"


def dcp_values(parts, flats, keys: dict[str, str], take=None) -> dict:
    """``parts`` ((parameter, holding, lo, hi)) as ``Boxes`` of the flat tensors ``flats[piece]`` by DCP key."""
    out: dict[str, tuple[tuple[int, ...], list]] = {}
    for p, h, a, b in parts:
        for key, t in flats[h.piece].items():
            out.setdefault(dcp_key(key, p.name, keys), (p.shape, []))[1].append(((a, b), h.of(t, a, b)))
    return {k: glue().Boxes(shape, ps, take) for k, (shape, ps) in out.items()}


def snapshot(engine, state, fmap, group: Group, zero_copy: bool) -> dict:
    """This rank's ``StateLayout.share`` of ``state`` as DCP values, with what the save records (collective); each box
    a host copy of exactly its bytes (DCP clones views of larger storages), or with ``zero_copy`` ``fmap``'s pages."""
    c = engine.components
    layout, flats, per, scalars, keys = _share(engine, state, group)
    release = fmap.release if fmap is not None else None
    # Checked on the host copies of the whole tensors (no device sync)
    whole = {k: host_copy(t) for k, t in whole_tensors(c.module).items()} if group.rank == 0 else None
    nonfinite = _nonfinite(layout, flats, keys, state, whole, release)
    # A replicated holding (ddp's) is written from one rank's copy (``share``): ``_agree_to_save`` compares these
    # digests, or a rank's copy changed alone would make a checkpoint that matches no rank.
    copies = read_per_device([((dcp_key(key, p.name, keys), h.lo, h.hi), bits_sum(h.of(t)))
                              for p, h in layout.replicated() for key, t in flats[h.piece].items()])

    def take(box: torch.Tensor) -> torch.Tensor:
        owned = fmap.own(box) if zero_copy and fmap is not None else None
        return owned if owned is not None else box.to("cpu", copy=True)

    out: dict[str, Any] = dcp_values(layout.share(), flats, keys, take)
    host_scalars = {p: host_copy(v) for p, v in scalars.items()}
    # DCP writes each once: the scalars (the same on every rank), rank 0's buffers and frozen parameters (whole on all)
    out.update({f"optim.{keys[p]}": torch.as_tensor(v, device="cpu").clone() for p, v in host_scalars.items()})
    out.update(whole or {})
    # the files' bytes: the tensors', with room for DCP's per-item records, the JSON files and the metadata
    nbytes = tensor_bytes(t for v in out.values() for t in (v.tensors() if isinstance(v, glue().Boxes) else [v])) \
        + 4096 * len(out) + (64 << 10)
    json_scalars = {p: {"tensor": v.tolist(), "dtype": dtype_name(v.dtype)} if isinstance(v, torch.Tensor) else v
                    for p, v in host_scalars.items()}
    train = {"step": state.step, "data": state.data, "scheduler_position": state.applied_steps,
             "precision": asdict(state.precision), "dynamic_loss_scale": c.policy.dynamic,
             "optimizer": {"per_element": sorted(per), "scalars": json_scalars, "keys": keys}}
    if (arch := architecture(c.module)) is not None:   # model=hf: what its config file resolved to
        train["model_config"] = arch
    if tied := tied_names(c.module):   # saved once: the other names, for get_fp32_state_dict_from_checkpoint
        train["tied"] = tied
    return {"dcp": out, "layout": layout.saved(), "train": train, "rng": rng.capture(state.rng), "step": state.step,
            "nonfinite": nonfinite, "copies": copies, "bytes": nbytes, "release": release if zero_copy else None}


def _share(engine, state, group: Group):
    """This rank's ``StateLayout`` of ``state`` (collective), ``pieces(state)`` and the optimizer's DCP key parts."""
    specs = engine.components.stage.piece_specs()
    flats, per, scalars = pieces(state, specs)
    layout = StateLayout.of(specs, dist=group, what="checkpoint layout gather")
    return layout, flats, per, scalars, optim_keys(sorted(per), sorted(scalars))


def _nonfinite(layout: StateLayout, flats, keys: dict[str, str], state, whole: dict | None, release=None) -> list[str]:
    """The pre-save check of this rank's share: masters and optimizer values holding NaN or inf, and with ``whole``
    (rank 0's buffers and frozen parameters) a NaN there (a NaN forward under on_nonfinite=warn leaves one in
    BatchNorm's statistics; an inf may be a mask) or a loss scale that is not a positive finite number."""
    names = nonfinite_items([(dcp_key(key, p.name, keys), h.of(t)) for p, h in layout.mine()
                             for key, t in flats[h.piece].items()], release)
    if whole is not None:
        names = sorted({*names, *nonfinite_items(list(whole.items()), nan_only=True)})
        scale = state.precision.cur_scale   # (a float, the same on every rank; a load refuses a bad one)
        if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
            names.append(f"precision.cur_scale ({scale!r})")
    return names


def _held(per_rank: list[list[str]]) -> str | None:
    """The ranks' non-finite values (``_nonfinite``'s, exchanged) said, or None."""
    bad = [f"rank {r}: {few(names)}" for r, names in enumerate(per_rank) if names]
    return f"the state holds non-finite values (NaN or inf) in {'; '.join(bad)}" if bad else None


def check_finite(ckpt, state, doing: str) -> None:
    """The pre-save check of ``state`` alone (collective), before ``doing`` (e.g. an export)."""
    engine, group = ckpt.engine, ckpt.group
    with contextlib.ExitStack() as stack:   # offload=nvme: the swap file, mapped and checked
        mapped, fmap = group.enter(stack, engine.mapped_state(state), "swap file check")
        layout, flats, _, _, keys = _share(engine, mapped, group)
        whole = whole_tensors(engine.components.module) if group.rank == 0 else None
        names = _nonfinite(layout, flats, keys, mapped, whole, fmap.release if fmap is not None else None)
    if held := _held(group.all_gather(names, "pre-save check")):
        raise on_every_rank(TrainingError(f"{doing}: {held}; stopping. Lower the learning rate or check the data; "
                                          f"train.on_nonfinite=warn writes such state with a warning"))


def save(ckpt, state, losses: list[float] | None = None):
    """Save ``state`` as ``<ckpt.root>/step-<state.step>`` (collective), its host copy taken before returning; with
    ``ckpt.pool`` written there (its future returned). ``ckpt.on_point``: at ``save-<N>:<point>``, fault tests'."""
    engine, group, root, background = ckpt.engine, ckpt.group, ckpt.root, ckpt.pool
    staged16 = None
    if engine.components.stage.weights_on_save():
        # stage3_gather_16bit_weights_on_model_save: written now (collective on the default group) into a folder
        # ``_write`` moves into the step folder as model_16bit/: committed, pruned and found with the step.
        if group.rank == 0:
            files.make_dirs(root)
        staged16 = root / f"step-{state.step}.model_16bit"
        try:   # (save_weights checks the room for its files first, and names the folder on a full disk; the state
            # check below reads the same masters: one line for NaN or inf, and the folder removed, not a warning)
            save_on_model_save(engine, staged16, check=False)
        except FrameworkError as e:
            if group.rank == 0:
                shutil.rmtree(staged16, ignore_errors=True)
            raise on_every_rank(CheckpointError(f"checkpoint: not saving step {state.step}: {e}; the previous "
                                                "checkpoints are kept"), e.every_rank) from None
    with contextlib.ExitStack() as stack:   # offload=nvme: the swap file, mapped and checked
        mapped, fmap = group.enter(stack, engine.mapped_state(state), "swap file check")
        if fmap is not None:
            # written from the swap file's pages on this thread: a background save would need a model-sized copy
            background = None
        snap = snapshot(engine, mapped, fmap, group, zero_copy=background is None)
        snap["train"]["recent_losses"] = [x for x in losses or () if math.isfinite(x)]   # (strict JSON)
        if ckpt.data is not None:   # what the ids stand for, and a stamp of the content (a resume compares them)
            snap["train"]["data_identity"] = ckpt.data
        # Fixed at submit: a background write keeps the settings of the save that made it.
        snap.update(writer=ckpt.writer, on_point=ckpt.on_point, keep_last=ckpt.cfg.keep_last)
        recheck = lambda: verify_map(fmap, "checked again after the checkpoint read it")  # noqa: E731
        if not _agree_to_save(ckpt, snap, staged16, recheck):
            return None
        if background is None:
            # inside the block: DCP reads the mapped pages before training changes them
            _write(ckpt, snap, staged16, recheck)
            return None
        agree_save(group, "swap file check after the host copy", recheck, root / f"step-{state.step}.tmp",
                   cleanup=False)
    return background.submit(_write, ckpt, snap, staged16)


_KEPT = "; the previous checkpoints are kept"


def _agree_to_save(ckpt, snap: dict, staged16: Path | None, recheck) -> bool:
    """Every rank's verdict on the state (finite, replicated copies alike) and the room, exchanged; True to save
    (``snap["need"]``: all ranks' bytes). Non-finite state is a TrainingError (unless ``recheck`` finds the swap file
    changed under it), differing copies or too little room a CheckpointError."""
    step, group, root = snap["step"], ckpt.group, ckpt.root
    problem, claim = None, None
    try:
        if group.rank == 0 and getattr(ckpt, "lock", None) is not None:   # (before any step folder is made)
            ckpt.lock.check()   # still this run's folder
        claim = Claim.of(root, snap["bytes"], group.rank)
        if snap["nonfinite"]:
            recheck()
    except OSError as e:
        problem = f"rank {group.rank}: cannot inspect {root} ({e.strerror or e}){_KEPT}"
    except LockTaken as e:   # (this run's checkpoints went with the folder: those there are the other run's)
        problem = f"rank {group.rank}: {e}"
    except FrameworkError as e:
        problem = f"rank {group.rank}: {e}{_KEPT}"
    everyone = group.all_gather((snap["nonfinite"], claim, problem, snap["copies"]), "pre-save check")
    held = _held([names for names, *_ in everyone])
    refused = f"checkpoint: not saving step {step}: {held}" if held else None
    problems = [p for _, _, p, _ in everyone if p] + (   # (non-finite copies: said as such, below)
        [] if held else [d + _KEPT for d in _differing([copies for *_, copies in everyone])])
    shorts = shortfalls([c for _, c, _, _ in everyone if c is not None]) if not problems else []
    if (refused or problems or shorts) and group.rank == 0 and staged16 is not None:
        shutil.rmtree(staged16, ignore_errors=True)
    # (each verdict below is drawn from the exchanged outcomes alone: every rank raises it alike)
    if problems:
        raise on_every_rank(CheckpointError(f"checkpoint: not saving step {step}: {problems[0]}"))
    if refused and ckpt.on_nonfinite == "warn":
        if group.rank == 0:
            print(f"warning: {refused} (train.on_nonfinite=warn)", file=sys.stderr, flush=True)
        return False
    if refused:
        raise on_every_rank(TrainingError(
            f"{refused}; stopping (the previous checkpoints are kept). Lower the learning rate or check the data; "
            "train.on_nonfinite=warn keeps training without saving such state"))
    if shorts:
        raise on_every_rank(CheckpointError(f"checkpoint: not saving step {step}: " + "; ".join(
            s.describe("the checkpoint files") for s in shorts) + f"; {room_fixes(snap['keep_last'])} (the "
            "previous checkpoints are kept)"))
    snap["need"] = sum(c.need for _, c, _, _ in everyone)   # every rank's files: one number on every rank
    snap["largest"] = max(c.need for _, c, _, _ in everyone)   # (DCP writes one file per rank)
    return True


def _differing(copies: list[list]) -> list[str]:
    """The first replicated holding whose digest (``snapshot``'s) differs between two ranks, said; else none."""
    first: dict = {}
    for r, mine in enumerate(copies):
        for (name, lo, hi), digest in mine:
            a, theirs = first.setdefault((name, lo, hi), (r, digest))
            if theirs != digest:
                return [f"ranks {a} and {r} hold different values of {name}, which every rank keeps a copy of (changed "
                        "on one rank alone?): a checkpoint would match neither; change it on every rank alike"]
    return []


def _write(ckpt, snap: dict, staged16: Path | None, recheck=None) -> None:
    """Write and commit the snapshot (collective), each phase ending in ``agree_save``; ``recheck``: before commit."""
    t0 = time.perf_counter()
    group, root, config = ckpt.group, ckpt.root, ckpt.config
    step, rank = snap["step"], group.rank
    tmp, final = root / f"step-{step}.tmp", root / f"step-{step}"
    need = snap["need"]
    meta = {"stage": config.get("stage", {}).get("name"), "offload": config.get("offload", {}).get("name"),
            "precision_policy": config.get("precision", {}).get("name"),
            "config_hash": hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16]}

    def point(name: str) -> None:
        if snap["on_point"] is not None:
            snap["on_point"](f"save-{step}:{name}")

    stuck: list[str] = []   # earlier saves' leftovers (step-N.del) the clean-up could not delete: said at the commit

    def make_folder():
        if rank == 0:
            files.make_dirs(root)
            stuck.extend(stepfolders.remove_stale(root, keep=staged16))
            files.make_dir(tmp, exist_ok=False)   # refused if anything (a planted link) is there
            if staged16 is not None:   # a subfolder: in the manifest, moved and pruned with the step
                os.replace(staged16, tmp / stepfolders.WEIGHTS16)

    agree_save(group, "making the folder", make_folder, tmp)   # the folder exists before any rank writes

    def write_files():
        dcp, where = glue(), group.dcp_kwargs()
        if where.get("no_dist"):   # (a lasting filter, set once: DCP is imported by the first save)
            dcp.quiet_no_dist()
        dcp.dcp.save(snap["dcp"], planner=dcp.SavePlanner(snap["release"]), **where,
                     storage_writer=(snap["writer"] or dcp.dcp.FileSystemWriter)(tmp, sync_files=True))
        files.write_new(tmp / f"rng-{rank}.json", json.dumps(snap["rng"]).encode())
        point("after-shard")
        if rank == 0:
            body = {"format": stepfolders.TRAIN_STATE_FORMAT, "state_format": STATE_FORMAT,
                    "framework_version": VERSION, **snap["train"], "world": group.world, **meta,
                    "config": config,
                    # The saving layout: each parameter's shape and the flat ranges each rank held.
                    **snap["layout"]}
            files.write_new(tmp / stepfolders.TRAIN_STATE, json.dumps(body).encode())
        if recheck is not None:
            recheck()

    agree_save(group, "writing the files", write_files, tmp, need=need, largest=snap["largest"],
               keep_last=snap["keep_last"])
    # Checksums: each rank hashes every world-th file, so the reading is spread over the ranks.
    parts = agree_save(group, "checksums", lambda: {n: stepfolders.file_entry(tmp, n)
                                                    for n in stepfolders.files_of(tmp)[rank::group.world]}, tmp)

    def commit():
        if rank != 0:
            return []
        entries = {k: v for part in parts for k, v in part.items()}
        point("before-manifest")
        unseen(tmp, entries, group.world)
        stepfolders.write_manifest(tmp, entries, step=step, world=group.world, stage=meta["stage"],
                                   config_hash=meta["config_hash"], verified=True, seq=stepfolders.next_seq(root))
        late = stepfolders.commit(tmp, final, point)
        try:
            gone, left = stepfolders.prune(root, final, snap["keep_last"], point)
            failed = left and f"could not delete all of {', '.join(map(str, left))}; the next save tries again"
        except (OSError, FrameworkError) as e:   # committed already: the older folders are left for the next save
            gone, failed = [], f"deleting the older checkpoints failed ({getattr(e, 'strerror', None) or e})"
        if stuck:   # (said at every save that fails to delete them: each keeps a checkpoint's disk space)
            again = f"still could not delete {', '.join(stuck)}: remove it by hand (the next save tries again)"
            failed = f"{failed}; {again}" if failed else again
        if failed:
            late = f"{late}; {failed}" if late else f"{final} committed; {failed}"
        if late:
            print(f"warning: checkpoint: {late}", file=sys.stderr, flush=True)
        total = sum(v["bytes"] for v in entries.values())
        print(f"checkpoint: saved {final} ({total / MiB:.1f} MiB in {time.perf_counter() - t0:.2f}s"
              + (f"; deleted {', '.join(p.name for p in gone)}" if gone else "") + ")", flush=True)

    agree_save(group, "commit", commit, tmp, need=need, keep_last=snap["keep_last"])


def unseen(tmp: Path, entries: dict[str, dict], world: int) -> None:
    """A CheckpointError unless ``tmp`` as rank 0 sees it holds exactly the files the ranks hashed and every
    ``rng-<rank>.json``: on a node-local ``checkpoint.dir`` the manifest would vouch for files it does not hold."""
    names = set(stepfolders.files_of(tmp))
    missing = sorted({*entries, *(f"rng-{r}.json" for r in range(world))} - names)
    extra = sorted(n for n in names - set(entries) if stepfolders.a_save_writes(n))
    if missing or extra:
        what = "; ".join(([f"rank 0 does not see {few(missing)} there, which the ranks wrote"] if missing else [])
                         + ([f"it holds {few(extra)}, which no rank hashed"] if extra else []))
        raise CheckpointError(f"{tmp} is not the folder every rank wrote ({what}): checkpoint.dir must be one "
                              "folder every rank sees; put it on a shared file system")
