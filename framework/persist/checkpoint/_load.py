"""Reading a checkpoint: files and train state against the manifest, the DCP files against this model, then
this rank's holdings read by DCP straight into the state's pieces, checked finite before the state goes on."""
from __future__ import annotations

import contextlib
import math
from dataclasses import asdict
from functools import partial
from pathlib import Path

import torch

from framework.config.schema import get_key
from framework.engine.state import initial_scalars
from framework.core.errors import CheckpointError, ConfigError, FrameworkError, UnsafePathError, on_every_rank, say
from framework.core.registry import registry
from framework.models.hf import CLASS_KEY, architecture, without_dtype
from framework.loggers import RUN_ONLY
from framework.persist import rng, stepfolders
from framework.persist.checkpoint._group import Group, agree_load, glue
from framework.persist.checkpoint._save import dcp_key, dcp_values, optim_keys
from framework.persist.layout import (StateLayout, check_format, nonfinite_items, pieces, trainable_switch,
                                      with_saved_scalars)
from framework.precision import PrecisionState
from framework.persist.weights import whole_tensors
from framework.core.utils import counted, few, under, yaml_spelling

# Model keys that may change between a save and a resume: how the same weights are computed.
_MODEL_FREE = {"activation_checkpointing", "attn_implementation", "dropout", "pretrained"}
# model=hf: also the sequence length (build keeps it within the model's positions) and, where the checkpoint
# recorded the resolved config (``architecture``, compared instead), the path of the file it was read from.
_HF_FREE, _HF_RECORDED_FREE = {"context"}, {"config"}


def saves_among(folder: Path, root: Path, every: int) -> bool:
    """Whether a run saving into ``root`` saves among ``folder``'s checkpoints (``fresh_start`` refuses others)."""
    return bool(every) and folder.parent.resolve() == root.resolve()


def afresh(resume: str, folder: Path, root: Path, every: int) -> str:
    """What a refusal of ``folder`` (another run's: no fallback) says to start afresh: resume=off; where the run saves
    among its checkpoints, which refuses that, another checkpoint.dir, with resume=off unless auto (a path, or latest,
    which searches the run folders wherever checkpoint.dir is, would read it again)."""
    if not saves_among(folder, root, every):
        return "set checkpoint.resume=off to start this run afresh"
    if resume == "auto":
        return "use another checkpoint.dir to start this run afresh"
    return "set checkpoint.resume=off and another checkpoint.dir to start this run afresh"


def same_run(folder: Path, saved: dict, mine: dict, resume: str, recorded=None, current: dict | None = None, *,
             way: str) -> None:
    """ConfigError unless ``saved`` (``folder``'s config) has the model and optimizer of ``mine`` (another model whose
    shapes happen to fit is still refused). ``recorded``: the HF model config the train state holds, compared with
    this model's ``current`` one where both are known. ``way``: ``afresh``'s advice."""
    free, whose = _MODEL_FREE, ""
    if mine["model"].get("name") == "hf":
        free = free | _HF_FREE | (_HF_RECORDED_FREE if isinstance(recorded, dict) else set())
    diffs = [k for k in changed(saved.get("model", {}), mine["model"]) if k not in free][:4]
    diffs = [(f"model.{k}", get_key(saved["model"], k), get_key(mine["model"], k)) for k in diffs]
    if not diffs and isinstance(recorded, dict) and current is not None:
        # Keys of both only (another transformers version may add a key with its default), the class aside.
        whose = "its config: "
        recorded = without_dtype(recorded)   # (as ``architecture`` gives ``current``: one recorded by an older build)
        diffs = [(k, recorded[k], current[k]) for k in sorted(set(recorded) & set(current) - {CLASS_KEY})
                 if recorded[k] != current[k]]
    if diffs:
        what = ", ".join(f"{k} {a!r} vs {b!r}" for k, a, b in diffs[:4])
        raise ConfigError(f"checkpoint.resume={resume}: {folder} was saved by another model ({whose}{what}; saved vs "
                          f"this run); {way}")
    other = _other_data(saved, mine)   # (a few dict reads: again here, not passed down)
    if other and other[1].startswith("data="):   # (not another data.vocab_size)
        raise ConfigError(f"checkpoint.resume={resume}: {folder} was {other[0]} (its data position counts batches of "
                          f"that data, not of this run's); resume with {other[1]}, or {way}")
    same_optimizer(folder, saved, mine, resume, way=way)


def same_optimizer(folder: Path, saved: dict, mine: dict, resume: str, *, way: str) -> None:
    """``same_run``'s optimizer half: a load checks it before the state's keys, which name no optimizer."""
    theirs = saved.get("optimizer", {}).get("name")
    if theirs is not None and theirs != mine["optimizer"]["name"]:
        raise ConfigError(f"checkpoint.resume={resume}: {folder} was saved with optimizer={theirs}, this run uses "
                          f"optimizer={mine['optimizer']['name']}; resume with optimizer={theirs}; {way}")


def job_values(config: dict, keys) -> dict:
    """``config``'s value of each of ``keys`` (naming a sweep's job), a group by its choice; checkpoint.resume (a
    checkpoint records where ``latest`` led) and ``RUN_ONLY`` aside."""
    def value(key: str):
        node = get_key(config, key)
        return node.get("name") if isinstance(node, dict) else node
    return {k: value(k) for k in sorted(keys) if k != "checkpoint.resume" and not under(k, RUN_ONLY)}


def other_job(saved: dict, mine: dict) -> list[tuple[str, str]]:
    """(``KEY=VALUE`` of the checkpoint's config ``saved``, of ``mine``) for each job key whose values differ."""
    theirs = job_values(saved, mine)
    return [(f"{k}={theirs[k]}", f"{k}={mine[k]}") for k in mine if theirs[k] != mine[k]]


# Where files lie and how many ranks run (said as "resharded"): no difference a resume lists. The
# swap files' default is in the run folder, so offload.nvme_path differs at every relaunch into a new one.
_UNLISTED = {"dist.nproc", "offload.nvme_path"}


def changed(a: dict, b: dict, prefix: str = "", values: bool = False, notes: dict | None = None) -> list[str]:
    """The dotted keys that differ between two config dicts (checkpoint.* and ``_UNLISTED`` aside); a group chosen
    anew is one entry, ``offload none->cpu``; ``values``: each key with its old and new value, ``optimizer.lr
    0.001->0.0005`` (a relaunch with ``resume=auto`` may not recall the old one); ``notes``: a dotted key -> the
    note in brackets after its entry where it differs."""
    out, notes = [], notes or {}
    for k in sorted(set(a) | set(b)):
        x, y, key = a.get(k), b.get(k), f"{prefix}{k}"
        if isinstance(x, dict) and isinstance(y, dict) and x.get("name") != y.get("name"):
            out.append(f"{key} {x.get('name')}->{y.get('name')}")
        elif isinstance(x, dict) and isinstance(y, dict):
            out += changed(x, y, f"{key}.", values, notes)
        elif x != y and not (prefix == "checkpoint." or key in _UNLISTED):
            out.append((f"{key} {_shown(x)}->{_shown(y)}" if values else key)
                       + (f" ({notes[key]})" if key in notes else ""))
    return out


def _shown(value, most: int = 40) -> str:
    """``value`` as the config spells it, cut to its last ``most`` characters (a path or a list stays readable on one
    line; paths mostly differ at their end: a file's name)."""
    text = " ".join(yaml_spelling(value).split())
    return text if len(text) <= most else "..." + text[3 - most:]


def batch_change(saved: dict, saved_world: int, mine: dict, world: int) -> str | None:
    """The resume line's note where the global batch (micro_batch x grad_accum x world) changed."""
    def rows(cfg: dict, world: int):
        micro, accum = get_key(cfg, "train.micro_batch"), get_key(cfg, "train.grad_accum")
        return micro * accum * world if isinstance(micro, int) and isinstance(accum, int) else None

    before, now = rows(saved, saved_world), rows(mine, world)
    if before is None or now is None or before == now:
        return None
    return (f"global batch {before} -> {now} rows (micro_batch x grad_accum x world); set train.micro_batch or "
            "train.grad_accum to keep it")


def schedule_change(saved: dict, cfg, position: int) -> str | None:
    """The resume line's note where train.steps changed and the scheduler's length follows it: the lr of the updates
    after ``position`` (those applied) moves, which a bare "config differs in train.steps" hides. None where no update
    follows or the scheduler or optimizer.lr changed too (its old lr is not this one's: "config differs in" names
    them)."""
    before, now = get_key(saved, "train.steps"), cfg.train.steps
    if not isinstance(before, int) or before < 1 or before == now or position >= now:
        return None
    if saved.get("scheduler") != cfg.to_dict().get("scheduler") or get_key(saved, "optimizer.lr") != cfg.optimizer.lr:
        return None
    name = cfg.choices["scheduler"]
    # (called as initialize calls it: base_lr by name)
    build = partial(registry("scheduler").get(name).build, cfg.scheduler, base_lr=cfg.optimizer.lr)
    try:
        old, new = build(total_steps=before), build(total_steps=now)
    except ConfigError:   # (this run's values were checked with its own length only)
        return None
    moved = _first_moved(old, new, position, now)
    if moved is None:   # a length of its own, or none, or past both ends
        return None
    key = next((k for k in ("total_num_steps", "decay_steps") if getattr(cfg.scheduler, k, 0) is None), None)
    keep = f"; set scheduler.{key}={before} to keep the saved run's" if key else ""
    which = "the next update's lr is" if moved == position else f"the lr moves from update {moved + 1} on:"
    return (f"the lr schedule (scheduler={name}) follows train.steps: it now spans {now} steps, not {before}, and "
            f"{which} {new(moved):.2e} (over {before} steps: {old(moved):.2e}){keep}")


def _first_moved(old, new, start: int, end: int) -> int | None:
    """The first update in [start, end) whose lr, as printed, differs between the schedules (a warm-up's are the
    same over either length): ~10,000 points on a grid, then the grid step before the first that differs."""
    differs = lambda i: f"{old(i):.2e}" != f"{new(i):.2e}"   # noqa: E731
    stride = max(1, (end - start) // 10_000)
    hit = next((i for i in range(start, end, stride) if differs(i)), None)
    return None if hit is None else next(i for i in range(max(start, hit - stride + 1), hit + 1) if differs(i))


def data_change(saved, mine) -> tuple[str, bool] | None:
    """(what differs between the saved and this run's ``DataSource.identity()``, whether the ids stand for other
    characters now); None where nothing is known to differ. Contents compare within one kind of source."""
    if not isinstance(saved, dict) or not isinstance(mine, dict):
        return None
    then, now = saved.get("vocab"), mine.get("vocab")
    if isinstance(then, str) and isinstance(now, str) and then != now:
        parts = [f"{word} {few(chars)}" for word, chars in (("adds", [c for c in now if c not in then]),
                                                            ("drops", [c for c in then if c not in now])) if chars]
        return f"{len(then)} -> {len(now)} characters, {' and '.join(parts)}", True
    if saved.get("source") != mine.get("source"):
        return None
    size = saved.get("bytes"), mine.get("bytes")
    # (without a checksum on both sides, the size is all that tells: a copy or a touch changes no content)
    differs = saved["sha256"] != mine["sha256"] if "sha256" in saved and "sha256" in mine else size[0] != size[1]
    return (f"{size[0]} -> {size[1]} bytes" if size[0] != size[1] else "the same size", False) if differs else None


_NEWER = "<newer>"   # (verify's mark of a newer version's manifest among the files' problems)


def verify(folder: Path, group: Group | None = None, resume: bool = False) -> dict:
    """The manifest, every file checked against it (each rank a share; one CheckpointError on every rank).
    ``resume`` (or an export: neither reads ``model_16bit/``): damage there is a line."""
    rank, world = (0, 1) if group is None else (group.rank, group.world)
    copy16 = f"{stepfolders.WEIGHTS16}/"
    copied = []   # (first in the line: it explains every file's mismatch below it)
    try:
        manifest = stepfolders.read_manifest(folder)
        copied = stepfolders.copied_manifest(folder, manifest)
        entries = manifest["files"]
        problems = [(n, p) for n in sorted(entries)[rank::world] if (p := stepfolders.check_file(folder, n, entries[n]))]
        if rank == 0:   # a file the manifest leaves out would be read unchecked
            # (older manifests list no model_16bit/ files: never read by a resume, refused by check_weights16)
            sub = any(n.startswith(copy16) for n in entries)
            unlisted = sorted(set(stepfolders.files_of(folder)) - set(entries))
            problems += [(n, f"{folder / n} is not in {stepfolders.MANIFEST} (a save lists every file it writes: "
                             "the manifest was edited, or the file added since)")
                         for n in unlisted if stepfolders.a_save_writes(n) and (sub or not n.startswith(copy16))]
            # (a name no save writes is never read: an editor's swap file or a user's notes are no damage)
            if other := [n for n in unlisted if not stepfolders.a_save_writes(n)]:
                # (stderr, as every warning: export prints the paths it wrote on stdout, for scripts to read)
                say(f"checkpoint: {folder} holds {few(other)}, which no save writes: ignored")
    except stepfolders.NewerVersion as e:   # (no damage: one refusal, on every rank)
        problems = [(_NEWER, e.what)]
    except (CheckpointError, UnsafePathError, OSError) as e:   # (the folder is named once, in the line below)
        problems = [("", str(e).removeprefix(f"checkpoint {folder}: "))]
    except (KeyError, TypeError, ValueError) as e:   # an edited manifest entry: refused on every rank like a bad file
        problems = [("", f"{folder / stepfolders.MANIFEST} has a malformed file entry ({type(e).__name__}: {e})")]
    everyone = [problems] if group is None else group.all_gather(problems, "checksum verification")
    found = {pair for part in everyone for pair in part}
    if newer := next((p for n, p in found if n == _NEWER), None):
        raise on_every_rank(stepfolders.NewerVersion(newer))   # (its advice: the caller's)
    unread = sorted(n for n, _ in found if resume and n.startswith(copy16))
    if bad := sorted(p for n, p in found if n not in unread):
        bad = "; ".join([*copied, *bad])
        raise on_every_rank(CheckpointError(f"checkpoint {folder} is damaged: {bad}"))   # (all found it)
    if unread and rank == 0:
        gone = [n for n in unread if not (folder / n).exists()]
        changed = [n for n in unread if n not in gone]
        what = "; ".join([*([f"{few(gone)} missing"] if gone else []),
                          *([f"{few(changed)} {'fails' if len(changed) == 1 else 'fail'} the manifest check"]
                            if changed else [])])
        say(f"checkpoint: {folder / stepfolders.WEIGHTS16} (the 16-bit weights copy) is damaged ({what}): going on, "
            "as resumes and exports do not read it (later saves write their own copy); load no weights from it")
    return manifest


_BODY_KEYS = ("state_format", "step", "data", "precision", "dynamic_loss_scale", "optimizer", "world", "stage",
              "config", "parameters", "fragments")


def _train_state(folder: Path, manifest: dict) -> dict:
    """train_state.json, checked against the manifest: a file edited or mixed from another save is refused."""
    path = folder / stepfolders.TRAIN_STATE
    body = stepfolders.read_json(path, "the train state")
    stepfolders.train_state_versions(body, folder)   # first: a newer version's file may lack or rename any other key
    missing = [k for k in _BODY_KEYS if k not in body] if isinstance(body, dict) else list(_BODY_KEYS)
    if missing:
        raise CheckpointError(f"checkpoint {folder}: {path} lacks {few(missing)}")
    check_format(body["state_format"], f"checkpoint {folder}")
    if isinstance(body["precision"], str) and body["dynamic_loss_scale"] is False:
        # Saved before train_state.json recorded the loss scaler (the policy's name alone): without dynamic
        # scaling no step was skipped, and no scale carries over (``with_saved_scalars``), so the record is the
        # scaler's initial one at that step.
        body["precision"] = asdict(PrecisionState(cur_iter=body["step"] if isinstance(body["step"], int) else 0))
    elif isinstance(body["precision"], str):   # (with dynamic scaling: its scale is not recorded; no damage)
        raise FrameworkError(f"checkpoint {folder} was saved by an earlier version of the framework ({path.name} "
                             f"precision {body['precision']!r}, before the loss-scaler record), which this version "
                             f"resumes without dynamic loss scaling only: export its weights (python -m "
                             f"framework.export {folder} --to DIR) and start afresh from them (load_weights)")
    world = body["world"]
    if not isinstance(world, int) or world < 1 or world != manifest.get("world"):
        raise CheckpointError(f"checkpoint {folder}: {path} says world size {world!r} but {stepfolders.MANIFEST} says "
                              f"{manifest.get('world')!r} (edited, or files of different saves)")
    layouts = len(body["fragments"]) if isinstance(body["fragments"], list) else None
    if body["step"] != manifest.get("step") or layouts != world:
        raise CheckpointError(f"checkpoint {folder}: {path} does not match {stepfolders.MANIFEST} (step {body['step']!r} "
                              f"vs {manifest.get('step')!r}, {layouts} rank layouts for world {world})")
    absent = [f"rng-{r}.json" for r in range(world) if f"rng-{r}.json" not in manifest["files"]]
    if absent:
        raise CheckpointError(f"checkpoint {folder}: {stepfolders.MANIFEST} lists no {few(absent)} for world size {world}")
    scale = body["precision"].get("cur_scale") if isinstance(body["precision"], dict) else None
    if not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise CheckpointError(f"checkpoint {folder}: {path} holds the loss scale {scale!r} (not a positive finite "
                              f"number)")
    return body


def load(engine, state, folder: Path, *, group: Group, seed: int, way: str, same: tuple[dict, str] | None = None,
         data: dict | None = None):
    """Check ``folder`` against this engine and return ``read``, which loads it into ``state`` and returns (state,
    train state). Damage: CheckpointError (auto falls back); with ``same`` (config dict, resume) another model or
    optimizer, or with ``data`` (``DataSource.identity()``) a changed vocabulary: ConfigError ending in ``way``.
    Collective."""
    # Before anything is read: the checks below and the read take the trainable set from requires_grad, which a
    # change after initialize makes disagree with the stage's layout (a parameter left unread, or called missing).
    agree_load(group, "requires_grad check", lambda: engine.check_trainable("checkpoint resume"))
    try:
        manifest = verify(folder, group, resume=True)
    except stepfolders.NewerVersion as e:   # (on every rank: verify's)
        raise on_every_rank(stepfolders.NewerVersion(e.what, f"resume it with that version, or {way}")) from None
    c = engine.components
    specs = c.stage.piece_specs()
    layout = StateLayout.of(specs, rank=group.rank, world=group.world)
    whole = whole_tensors(c.module)   # buffers and frozen parameters

    def check():
        try:   # (first: the versions, then the rest)
            body = _train_state(folder, manifest)
        except stepfolders.NewerVersion as e:
            raise stepfolders.NewerVersion(e.what, f"resume it with that version, or {way}") from None
        _, per, scalars = pieces(state, specs)
        md = glue().read_metadata(folder / ".metadata")
        named = same is not None and isinstance(body["config"], dict) and \
            body["config"].get("optimizer", {}).get("name") is not None
        if named:   # (the state's keys only where no name says it)
            same_optimizer(folder, body["config"], *same, way=way)
        if (change := data_change(body.get("data_identity"), data)) and change[1]:   # (before a shape names it)
            raise ConfigError(f"checkpoint.resume={same[1] if same else folder}: {folder} was saved with other data: "
                              f"the vocabulary of {data['path']} changed ({change[0]}), so its token ids now stand "
                              f"for other characters; restore the data file it was saved with to resume, or {way}")
        other = same and isinstance(body["config"], dict) and _other_data(body["config"], same[0])
        _fits(c, folder, body, md, layout, per, scalars, whole, way, named, other)   # names a shape that differs
        if same is not None and isinstance(body["config"], dict):
            same_run(folder, body["config"], *same, body.get("model_config"), architecture(c.module), way=way)
        return body, md

    body, md = agree_load(group, f"checkpoint check of {folder}", check)
    return partial(_read, engine, state, folder, body, md, layout, whole, group, seed)


def _read(engine, state, folder: Path, body: dict, md, layout: StateLayout, whole: dict, group: Group, seed: int):
    c = engine.components
    with contextlib.ExitStack() as stack:   # offload=nvme: the new layout's swap files, mapped writable
        mapped, fmap = group.enter(stack, engine.mapped_state(state, write=True), "swap file mapping")
        # DCP reads every holding straight into its piece (a swapped one into the mapped file): a read that fails
        # or is not finite raises on every rank, and resume stops or falls back to one that overwrites every holding.
        release = fmap.release if fmap is not None else None   # pages leave as they are filled
        flats, per, own = pieces(mapped)
        # State the checkpoint lacks (SGD's momentum_buffer, saved with momentum=0; ``_fits`` admits it for the same
        # optimizer only) starts as the optimizer's init starts it, as in torch.optim, whatever the engine stepped
        # before this resume; state this optimizer keeps none of is not read.
        saved = body["optimizer"]
        fresh, unread = _state_change(saved, per, own)
        first = initial_scalars(c.update.tx, mapped.params) if fresh else {}   # (only what the checkpoint lacks)
        if (fresh or unread) and group.rank == 0:
            said = ([f"holds no optimizer state {', '.join(fresh)}: {'it starts' if len(fresh) == 1 else 'they start'} "
                     f"anew at this resume, as in torch.optim"]
                    if fresh else []) + ([f"holds optimizer state {', '.join(unread)} that this optimizer keeps none "
                                          "of: not read"] if unread else [])
            print(f"checkpoint: {folder} (saved with other optimizer settings) {'; '.join(said)}", flush=True)
        targets = dcp_values([(p, h, h.lo, h.hi) for p, h in layout.mine()],
                             [{k: t for k, t in f.items() if k == "master" or k in saved["per_element"]} for f in flats],
                             saved["keys"])
        # read into host tensors, into the module once every rank read its share (a refused load leaves it)
        read_whole = {k: torch.empty(t.shape, dtype=t.dtype, device="cpu") for k, t in whole.items()
                      if k in md.state_dict_metadata}
        if whole and not read_whole and group.rank == 0:
            print(f"checkpoint: {folder} holds no buffers or frozen parameters (saved before checkpoints had them): "
                  f"{few(sorted(whole))} keep this model's values", flush=True)

        def read():
            glue().read(folder, md, {**targets, **read_whole}, release, **group.dcp_kwargs())
            bad = nonfinite_items([(k, t) for k, b in targets.items() for t in b.tensors()], release)
            bad += nonfinite_items(list(read_whole.items()), nan_only=True)   # (host tensors: no device sync)
            if bad:
                raise CheckpointError(f"checkpoint {folder}: non-finite values (NaN or inf) in {few(bad)} "
                                      f"(rank {group.rank}'s share): not a state to train from")
            torch_rng, host_rng = _rng_of(c, folder, body, seed)
            scalars = {**first, **{p: torch.tensor(v["tensor"], dtype=getattr(torch, v["dtype"]), device="cpu")
                                 if isinstance(v, dict) and "tensor" in v else v for p, v in saved["scalars"].items()}}
            return with_saved_scalars(mapped, body, torch_rng, scalars, c.policy), host_rng

        # From here a failure leaves the state partly the folder's: the engine refuses to step, evaluate or save
        # until a load finishes (a fallback to an older checkpoint that reads whole does).
        engine.start_load("checkpoint resume")
        loaded, host_rng = agree_load(group, f"reading {folder}", read)
    with torch.no_grad():
        for k, values in read_whole.items():
            whole[k].copy_(values)
    state = engine.finish_load(state, loaded)
    rng.restore_host(host_rng)
    return state, body


def _rng_of(c, folder: Path, body: dict, seed: int):
    """(torch, host) generator states: each rank its own under the same world size, else re-derived; saved on another
    kind of device, the device generator's derived (or dropped)."""
    rank, device = c.dist.rank, c.dist.device
    derived = rng.derive(seed, body["step"], rank, device)
    if body["world"] != c.dist.world:
        return derived
    saved = stepfolders.read_json(folder / f"rng-{rank}.json", "random generator states")
    try:
        states = rng.torch_states(saved)
        if not states:
            raise ValueError("not even the CPU generator's")
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint {folder}: rng-{rank}.json holds no valid generator states ({e})") from None
    want = derived[0]
    if len(states) != len(want):
        if rank == 0:
            print(f"checkpoint: {folder} was saved on another kind of device; " + (
                f"its {counted(len(states) - 1, 'device generator state')} per rank "
                f"{'is' if len(states) == 2 else 'are'} dropped (this run is on the {device.type})"
                if len(states) > len(want) else
                f"this run's {device.type} generator is derived from (seed, step, rank), so its draws (dropout) are "
                f"not those of an uninterrupted run") + "; the CPU generators resume as saved", flush=True)
        states = states[:1] + want[1:]
    return states, saved


def _state_change(opt: dict, per: dict, scalars: dict) -> tuple[list[str], list[str]]:
    """(this optimizer's state, ``per`` and ``scalars``, that the saved ``opt`` lacks; the saved state this one lacks)
    by torch.optim's names: the per-element states, or the scalars where none differs (SGD keeps no "step": one named
    beside them reads as the training step)."""
    mine, theirs = optim_keys(sorted(per), sorted(scalars)), [*opt["per_element"], *opt["scalars"]]

    def named(keys: list[str], per_element, names: dict[str, str]) -> list[str]:
        return sorted(names[k] for k in ([k for k in keys if k in per_element] or keys))

    return (named([k for k in mine if k not in theirs], per, mine),
            named([k for k in theirs if k not in mine], opt["per_element"], opt["keys"]))


def _fits(c, folder: Path, body: dict, md, layout: StateLayout, per: dict, scalars: dict,
          whole: dict[str, torch.Tensor], way: str, named: bool, other: tuple[str, str] | None) -> None:
    """ConfigError for another model or optimizer; CheckpointError when the files lack what the train state names.
    ``named``: the saved config names this optimizer, so other state is another setting of it (SGD's momentum);
    ``other``: ``_other_data``'s, to explain a shape that differs in the vocabulary's dimension."""
    opt = body["optimizer"]
    if not named and any(_state_change(opt, per, scalars)):
        theirs = sorted(opt["keys"][k] for k in [*opt["per_element"], *opt["scalars"]])
        raise ConfigError(f"checkpoint {folder} holds the optimizer state [{', '.join(theirs)}] but this optimizer "
                          f"keeps [{', '.join(sorted(optim_keys(sorted(per), sorted(scalars)).values()))}]; resume "
                          f"with the optimizer it was saved with; {way}")
    saved = {n: p.shape for n, p in StateLayout.in_checkpoint(md).params.items()}
    trainable = [n for n, p in c.module.named_parameters() if p.requires_grad]
    _same_trainable(folder, trainable, saved, md.state_dict_metadata, whole, way)
    _same_names(folder, trainable, saved, way, "parameters ")
    for p in layout.params.values():
        _same_shape(folder, f"parameter {p.name!r}", saved[p.name], p.shape, way, other, c.module)
    if kept := {k: tuple(v.size) for k, v in md.state_dict_metadata.items() if k.startswith(("buffer.", "frozen."))}:
        _same_names(folder, whole, kept, way)
    for k in kept:
        _same_shape(folder, repr(k), kept[k], tuple(whole[k].shape), way, other, c.module)
    wanted = [dcp_key(key, n, opt["keys"]) for n in layout.params
              for key in ("master", *(k for k in per if k in opt["per_element"]))]
    if absent := sorted(set(wanted) - set(md.state_dict_metadata)):
        raise CheckpointError(f"checkpoint {folder}: the DCP files lack {few(absent)}")


def _same_trainable(folder: Path, trainable: list[str], saved: dict, keys, whole: dict, way: str) -> None:
    """ConfigError naming the parameters frozen when saved and trainable now, or the reverse, not "missing"."""
    if switched := trainable_switch(trainable, saved, keys, whole):
        raise ConfigError(f"checkpoint {folder}: parameters {switched}; set their requires_grad as when saved to "
                          f"resume from it, or start afresh from its weights alone (python -m framework.export "
                          f"{folder} --to DIR, then framework.load_weights(engine, DIR); {way})")


def _other_data(saved: dict, mine: dict) -> tuple[str, str] | None:
    """(how the saved run's data group differs from ``mine``'s in kind or vocab_size, the overrides that resume it)."""
    then, now = saved.get("data"), mine.get("data")
    if not isinstance(then, dict) or not isinstance(now, dict):
        return None
    if then.get("name") != now.get("name"):
        return f"saved with data={then.get('name')}, this run uses data={now.get('name')}", f"data={then.get('name')}"
    if then.get("vocab_size") != now.get("vocab_size") and "vocab_size" in then:
        return (f"data.vocab_size {_shown(then['vocab_size'])}->{_shown(now.get('vocab_size'))}",
                f"data.vocab_size={_shown(then['vocab_size'])}")
    return None


def _same_names(folder: Path, mine, saved, way: str, what: str = "") -> None:
    missing, extra = sorted(set(mine) - set(saved)), sorted(set(saved) - set(mine))
    if missing or extra:
        parts = [f"{word} {what}{few(names)}" for word, names in (("missing", missing), ("unexpected", extra)) if names]
        raise ConfigError(f"checkpoint {folder} does not fit this model: " + "; ".join(parts) + f"; {way}")


def _in_vocab(saved: tuple, mine: tuple, module) -> bool:
    """Whether the shapes differ in one dimension alone, in ``mine`` the model's vocabulary (input embedding rows)."""
    try:
        rows = module.get_input_embeddings().num_embeddings
    except (AttributeError, NotImplementedError):   # (a model without one: no dimension is known as the vocabulary's)
        return False
    differ = [i for i, (a, b) in enumerate(zip(saved, mine)) if a != b]
    return len(saved) == len(mine) and len(differ) == 1 and mine[differ[0]] == rows


def _same_shape(folder: Path, what: str, saved: tuple, mine: tuple, way: str, other: tuple[str, str] | None,
                module) -> None:
    if saved == mine:
        return
    # (the data change explains it only where the vocabulary's dimension differs)
    how = (f" ({other[0]}: the data sets the model's vocabulary); resume with {other[1]}, or {way}"
           if other and _in_vocab(tuple(saved), tuple(mine), module) else f"; {way}")
    raise ConfigError(f"checkpoint {folder}: {what} has shape {saved} in the checkpoint but {mine} in this model{how}")
