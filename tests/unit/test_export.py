"""python -m framework.export: a DCP checkpoint folder (contract D: ``model.<name>`` fp32 masters at
global shapes) -> consolidated safetensors the plain model loads; streamed (measured peak RSS)."""
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from framework.core.errors import CheckpointError, ConfigError
from framework.cli.export import main
from framework.persist.export import get_fp32_state_dict_from_checkpoint
from tests._helpers import build_gpt, tiny_config


def _dcp_save(state: dict, path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # "assuming the intent is to save in a single process"
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)


def _checkpoint(tmp_path):
    """A checkpoint dir with step-3 (the plain GPT's weights + optimizer-like keys) and ``latest``."""
    plain, _ = build_gpt(tiny_config(), seed=99)
    sd = plain.state_dict()
    state = {**{f"model.{k}": v.clone() for k, v in sd.items()},
             **{f"optim.exp_avg.{k}": torch.zeros_like(v) for k, v in sd.items()}, "optim.step": torch.tensor(3)}
    _dcp_save(state, tmp_path / "ckpt" / "step-3")
    (tmp_path / "ckpt" / "latest").write_text("step-3\n")
    return sd


def _read(out_dir) -> dict:
    from safetensors.torch import load_file
    out = {}
    for p in sorted(out_dir.glob("*.safetensors")):
        out.update(load_file(p))
    return out


def test_export_loads_into_the_plain_model(tmp_path, capsys):
    sd = _checkpoint(tmp_path)
    # The checkpoint directory (following latest), sharded output with an index.
    assert main([str(tmp_path / "ckpt"), "--to", str(tmp_path / "out"), "--max-shard-size", "20KB"]) == 0
    printed = capsys.readouterr().out.split()
    assert printed[-1].endswith("model.safetensors.index.json") and len(printed) > 3
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(sd)   # model.* only, names without the prefix
    plain, _ = build_gpt(tiny_config(), seed=5)
    plain.load_state_dict(_read(tmp_path / "out"), strict=True)
    assert all(torch.equal(v, sd[k]) for k, v in plain.state_dict().items())
    # A step folder, bf16, one file.
    assert main([str(tmp_path / "ckpt" / "step-3"), "--to", str(tmp_path / "bf16"), "--dtype", "bf16"]) == 0
    out = _read(tmp_path / "bf16")
    assert all(out[k].dtype == torch.bfloat16 and torch.equal(out[k], v.to(torch.bfloat16)) for k, v in sd.items())
    # zero_to_fp32's name.
    fp32 = get_fp32_state_dict_from_checkpoint(tmp_path / "ckpt")
    assert fp32.keys() == sd.keys() and all(torch.equal(fp32[k], v) for k, v in sd.items())


def test_export_keeps_one_output_file_open_at_a_time(tmp_path, monkeypatch):
    """Many shards (a large model, a small --max-shard-size) under the descriptor limit: one file open at once."""
    from framework.core import files
    _checkpoint(tmp_path)
    most, write_at = [0], files.write_at

    def counting(fd, *a, **k):   # the .tmp outputs open while a value is written
        tmp = [n for n in os.listdir("/proc/self/fd") if os.path.realpath(f"/proc/self/fd/{n}").endswith(".tmp")]
        most[0] = max(most[0], len(tmp))
        return write_at(fd, *a, **k)

    monkeypatch.setattr(files, "write_at", counting)
    assert main([str(tmp_path / "ckpt"), "--to", str(tmp_path / "out"), "--max-shard-size", "1KB"]) == 0
    assert len(list((tmp_path / "out").glob("*.safetensors"))) > 5 and most[0] == 1, most


@pytest.mark.parametrize("signum", ["SIGTERM", "SIGINT"])
def test_a_signalled_export_leaves_nothing_and_says_so_in_one_line(tmp_path, capsys, monkeypatch, signum):
    """SIGTERM (Slurm, timeout) or Ctrl-C mid-write: one line, exit 143/130, no .tmp, lock or folder it made left."""
    import signal

    from framework.core import files
    _checkpoint(tmp_path)
    writes, write_at = [0], files.write_at

    def signalled(fd, *a, **k):   # the signal arrives while the third value is written
        writes[0] += 1
        if writes[0] == 3:
            os.kill(os.getpid(), getattr(signal, signum))
        return write_at(fd, *a, **k)

    monkeypatch.setattr(files, "write_at", signalled)
    before = signal.getsignal(signal.SIGTERM)
    out = tmp_path / "made" / "out"
    assert main([str(tmp_path / "ckpt"), "--to", str(out), "--max-shard-size", "20KB"]) == 128 + getattr(signal, signum)
    err = capsys.readouterr().err
    said = "terminated (SIGTERM)" if signum == "SIGTERM" else "interrupted"
    assert err.startswith(f"error: export: {said}") and err.count("\n") == 1, err
    assert writes[0] == 3 and sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert signal.getsignal(signal.SIGTERM) is before


def test_export_errors_are_one_line(tmp_path, capsys):
    assert main([str(tmp_path), "--to", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: export: ") and "\n" not in err and "is not a checkpoint" in err
    _dcp_save({"optim.step": torch.tensor(1)}, tmp_path / "nomodel")
    with pytest.raises(ConfigError, match="holds no 'model.<name>' tensors"):
        get_fp32_state_dict_from_checkpoint(tmp_path / "nomodel")


def _flip_a_byte(step):
    """Alter one byte in the middle of a DCP shard of ``step`` (same size); return the shard."""
    shard = next(step.glob("*.distcp"))
    with open(shard, "r+b") as f:
        f.seek(shard.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    return shard


def test_a_damaged_checkpoint_is_refused_not_exported(tmp_path, capsys):
    """A step folder our save wrote carries a manifest (sizes and sha256): export checks every file
    against it first, so a byte altered in a shard (same size) is one line naming the file, exit 1,
    and no output."""
    from framework.persist import stepfolders

    _checkpoint(tmp_path)
    step = tmp_path / "ckpt" / "step-3"
    stepfolders.write_manifest(step, {n: stepfolders.file_entry(step, n) for n in stepfolders.files_of(step)}, step=3)
    assert main([str(tmp_path / "ckpt"), "--to", str(tmp_path / "ok")]) == 0   # intact: exported
    shard = _flip_a_byte(step)
    capsys.readouterr()
    assert main([str(tmp_path / "ckpt"), "--to", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and f"{shard} does not match its sha256" in err, err
    assert not (tmp_path / "out").exists()
    with pytest.raises(CheckpointError, match="is damaged"):
        get_fp32_state_dict_from_checkpoint(step)


def test_a_step_a_live_run_rotates_away_while_it_is_read_is_no_damage(tmp_path, capsys, monkeypatch):
    """Exporting the folder of a run that is saving there: its rotation may remove the step being read. That is
    no damage nor a permission: the folder's newest step then is read, once; else one line naming the run (its
    lock, where a run holds it) and the way out, exit 1 (was "cannot read .../.metadata ...; check ...
    their permissions")."""
    import fcntl
    import shutil

    from framework.persist import export as reader, stepfolders

    _checkpoint(tmp_path)
    root = tmp_path / "ckpt"
    shutil.copytree(root / "step-3", root / "step-2")
    for n in (2, 3):
        step = root / f"step-{n}"
        stepfolders.write_manifest(step, {f: stepfolders.file_entry(step, f) for f in stepfolders.files_of(step)},
                                   step=n, seq=n)
    (root / ".lock").write_text("pid 7 on host h\n")
    holding = open(root / ".lock", "rb")   # that run's lock, held as cli/launch holds it
    fcntl.flock(holding.fileno(), fcntl.LOCK_EX)
    doomed, verify = {"step-3"}, reader.verify

    def rotated(d, **kwargs):   # the run's rotation, as the check reads the step
        if d.name in doomed:
            shutil.rmtree(d)
        return verify(d, **kwargs)

    monkeypatch.setattr(reader, "verify", rotated)
    assert main([str(root), "--to", str(tmp_path / "out")]) == 0   # the step the run keeps
    assert "exporting step-2" in capsys.readouterr().err
    doomed.add("step-2")
    shutil.copytree(root / "step-2", tmp_path / "spare")
    shutil.copytree(root / "step-2", root / "step-3")
    assert main([str(root), "--to", str(tmp_path / "out2")]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (f"error: export: {root / 'step-2'} was removed while it was read: the run holding {root / '.lock'} "
                   "(pid 7 on host h) rotates its checkpoints; run the export again, or export a step that run keeps "
                   "(checkpoint.keep_last)"), err
    assert not (tmp_path / "out2").exists()
    holding.close()   # no run holds the lock now (the run it names ended): another process removed the step
    for n in (2, 3):
        shutil.copytree(tmp_path / "spare", root / f"step-{n}")
    assert main([str(root), "--to", str(tmp_path / "out2")]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"error: export: {root / 'step-2'} was removed while it was read: another process removed "
                          f"it (no run holds {root / '.lock'}); "), err


@pytest.mark.parametrize("ours", ["train_state.json", "rng-0.json"])
def test_a_checkpoint_of_ours_without_its_manifest_is_refused(tmp_path, capsys, ours):
    """A step folder our save wrote (its train_state.json or an rng-<rank>.json) whose manifest.json
    was deleted cannot be checked: refused as damaged on one line naming the folder and the missing
    manifest (as resume refuses it), not exported unchecked. (A plain DCP folder, none of those files,
    is exported: test_export_loads_into_the_plain_model.)"""
    _checkpoint(tmp_path)
    step = tmp_path / "ckpt" / "step-3"
    (step / ours).write_text("{}")
    _flip_a_byte(step)
    capsys.readouterr()
    assert main([str(tmp_path / "ckpt"), "--to", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: checkpoint {step} is damaged: ") and "\n" not in err, err
    assert "no manifest.json (deleted, or an interrupted save)" in err, err
    assert not (tmp_path / "out").exists()
    with pytest.raises(CheckpointError, match=f"checkpoint {step} is damaged: .*no manifest.json"):
        get_fp32_state_dict_from_checkpoint(step)


# Peak RSS of an export in a fresh process, after a warm-up export of a tiny checkpoint (so
# imports and DCP's lazily built state are in the baseline): the growth is bounded by a few
# output shards, while reading the whole model (get_fp32_state_dict_from_checkpoint, the
# control that shows the measurement can fail) grows by the model. The kernel's high-water mark
# (VmHWM, what getrusage's ru_maxrss reads) is reset after the warm-up through clear_refs: a
# process started from this one inherits this one's maximum in ru_maxrss.
_PROBE = r"""
import json, sys
from framework.cli.export import main
from framework.persist.export import get_fp32_state_dict_from_checkpoint
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
mode, tiny, ckpt, out = sys.argv[1:5]
assert main([tiny, "--to", out + "-warm"]) == 0
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")   # reset the peak RSS to the current RSS
base = status("VmHWM")
if mode == "export":
    assert main([ckpt, "--to", out, "--max-shard-size", "16MB"]) == 0
else:
    sd = get_fp32_state_dict_from_checkpoint(ckpt)
print(json.dumps({"growth": status("VmHWM") - base}))
"""


def test_export_peak_memory_is_one_shard_not_the_model(tmp_path):
    n_tensors, numel = 16, 2**20      # 16 tensors of 4 MiB: a 64 MiB model; 16 MB output shards
    g = torch.Generator().manual_seed(0)
    _dcp_save({f"model.layer.{i}.weight": torch.randn(1024, numel // 1024, generator=g) for i in range(n_tensors)},
              tmp_path / "big")
    _dcp_save({"model.w": torch.ones(4, 4)}, tmp_path / "tiny")
    model, shard = n_tensors * numel * 4, 16 * 10**6

    def growth(mode):
        p = subprocess.run([sys.executable, "-c", _PROBE, mode, str(tmp_path / "tiny"), str(tmp_path / "big"),
                            str(tmp_path / f"out-{mode}")], capture_output=True, text=True, timeout=240)
        assert p.returncode == 0, p.stderr
        return json.loads(p.stdout.strip().splitlines()[-1])["growth"]

    streamed, whole = growth("export"), growth("whole")
    print(f"export peak RSS growth {streamed} B, whole-model read {whole} B, model {model} B")
    # Measured on the 2-core Xeon: 8.5 MB (about two 4 MiB tensors: the tensor and DCP's read of it) vs 88 MB.
    assert whole > 0.9 * model, (whole, model)        # the probe sees a whole-model read
    assert streamed < 1.5 * shard, (streamed, shard)  # the export held at most about one shard
    assert len(list((tmp_path / "out-export").glob("*.safetensors"))) == 6   # 3 tensors of 4 MiB fit in 16 MB


class _Boom:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os
        return (os.system, (f"touch {self.marker}",))


def test_crafted_metadata_is_refused_without_running_it(tmp_path, capsys):
    import pickle
    step = tmp_path / "step-1"
    step.mkdir()
    (step / ".metadata").write_bytes(pickle.dumps(_Boom(tmp_path / "ran")))
    assert main([str(step), "--to", str(tmp_path / "out")]) == 1
    assert "refused to read the DCP metadata" in capsys.readouterr().err
    assert not (tmp_path / "ran").exists()


def test_an_output_that_cannot_be_written_names_to(tmp_path, capsys):
    _checkpoint(tmp_path)
    (tmp_path / "afile").write_text("x")
    capsys.readouterr()
    assert main([str(tmp_path / "ckpt"), "--to", str(tmp_path / "afile")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: export: cannot write {tmp_path / 'afile'} (") and err.count("\n") == 1, err


def test_a_failed_export_keeps_the_earlier_one_and_names_to(tmp_path, capsys):
    """No room (a file size limit here): one line naming --to, the earlier export there whole, no .tmp left."""
    from tests._helpers import file_size_limit
    _checkpoint(tmp_path)
    out = tmp_path / "out"
    assert main([str(tmp_path / "ckpt"), "--to", str(out), "--max-shard-size", "20KB"]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    for shard in ("20KB", "5GB"):
        capsys.readouterr()
        with file_size_limit(4000):
            assert main([str(tmp_path / "ckpt"), "--to", str(out), "--max-shard-size", shard, "--overwrite"]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"error: export: cannot write {out} (") and "no room" in err and err.count("\n") == 1, err
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_an_export_into_a_folder_another_export_is_writing_is_refused(tmp_path, capsys):
    """Two exports into one --to would remove and rename each other's .tmp files, one reporting success over the
    other's weights: the second is refused in one line naming the holder, the first's files as they were. A lock
    file a killed export left is no export file (no --overwrite needed) and is taken over."""
    import socket

    from framework.core import files
    from framework.persist.tensorfiles import LOCK
    _checkpoint(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK).write_text("pid 1 on host gone\n")   # a killed export's: held by nobody
    assert main([str(tmp_path / "ckpt"), "--to", str(out)]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert list(before) == ["model.safetensors"]
    fd = files.lock(out / LOCK, str, "")   # another export writing there, its .tmp file beside
    (out / "model.safetensors.tmp").write_bytes(b"theirs")
    try:
        capsys.readouterr()
        assert main([str(tmp_path / "ckpt"), "--to", str(out), "--overwrite"]) == 1
        assert capsys.readouterr().err == (f"error: export: {out} is being written by another save (pid {os.getpid()} "
                                           f"on host {socket.gethostname()}): wait for it to end or choose another "
                                           "output folder\n")
        after = {p.name: p.read_bytes() for p in out.iterdir() if p.name != LOCK}
        assert after == {**before, "model.safetensors.tmp": b"theirs"}
    finally:
        os.close(fd)


def test_a_read_error_naming_no_file_is_a_read_error(tmp_path, capsys, monkeypatch):
    """A checkpoint read failing with an errno alone (EIO from a dying disk) is said to be a read, never blamed
    on --to (every write error names --to itself)."""
    import errno

    from framework.persist import export as export_module
    _checkpoint(tmp_path)

    def failing(self, names):
        raise OSError(errno.EIO, "Input/output error")
    monkeypatch.setattr(export_module.Checkpoint, "read", failing)
    capsys.readouterr()
    assert main([str(tmp_path / "ckpt"), "--to", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: export: cannot read {tmp_path / 'ckpt'} (Input/output error)"), err
    assert err.count("\n") == 1 and not list((tmp_path / "out").glob("*.tmp")), err
    # The folders the failed export made are removed again (empty); one that was there stays.
    assert not (tmp_path / "out").exists()
    assert main([str(tmp_path / "ckpt"), "--to", str(tmp_path / "new" / "out")]) == 1
    assert not (tmp_path / "new").exists()
    (tmp_path / "there").mkdir()
    assert main([str(tmp_path / "ckpt"), "--to", str(tmp_path / "there")]) == 1
    assert (tmp_path / "there").is_dir() and not os.listdir(tmp_path / "there")
    assert main([str(tmp_path / "ckpt"), "--to", str(tmp_path / "not-made" / ".." / "there")]) == 1
    assert (tmp_path / "there").is_dir()   # (the user's, named through ".."; "not-made" the kernel made stays)


def test_a_missing_checkpoint_says_so_and_lists_the_steps(tmp_path, capsys):
    from framework.persist import stepfolders

    _checkpoint(tmp_path)
    step = tmp_path / "ckpt" / "step-3"
    stepfolders.write_manifest(step, {n: stepfolders.file_entry(step, n) for n in stepfolders.files_of(step)}, step=3)
    capsys.readouterr()
    for where, want in ((tmp_path / "ckpt" / "step-99", f"error: export: {tmp_path / 'ckpt' / 'step-99'} does not "
                                                        f"exist; the committed checkpoints in {tmp_path / 'ckpt'}: step-3\n"),
                        (tmp_path / "nothing", f"error: export: {tmp_path / 'nothing'} does not exist\n")):
        assert main([str(where), "--to", str(tmp_path / "out")]) == 2
        assert capsys.readouterr().err == want
    assert not (tmp_path / "out").exists()


def test_a_folder_holding_another_models_files_is_refused(tmp_path, capsys):
    """An export never deletes another model's shards silently nor leaves a config.json that does not match: a
    --to holding weights or a config.json is one line naming a file and the ways out; --overwrite replaces the
    weights (the config.json stays, said), other weights (that it would not replace) are refused even then."""
    sd = _checkpoint(tmp_path)
    out = tmp_path / "llama"
    out.mkdir()
    theirs = {"model-00001-of-00002.safetensors": "a", "model-00002-of-00002.safetensors": "b",
              "model.safetensors.index.json": "{}", "config.json": '{"model_type": "llama"}'}
    for name, text in theirs.items():
        (out / name).write_text(text)
    capsys.readouterr()
    assert main([str(tmp_path / "ckpt"), "--to", str(out)]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: export: {out} already holds model-00001-of-00002.safetensors, model-00002-of-00002.safetensors "
                   f"and 2 more: choose an empty folder, or give --overwrite to replace the weights there (its config.json "
                   f"stays as it is: export writes only the weights)\n"), err
    assert {p.name: p.read_text() for p in out.iterdir()} == theirs
    (out / "config.json").unlink()
    (out / "model.safetensors.index.json").unlink()
    (out / "pytorch_model.bin").write_text("c")
    assert main([str(tmp_path / "ckpt"), "--to", str(out), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: export: {out} holds pytorch_model.bin: weights the export would leave beside its own; "
                   f"choose an empty folder (or remove them)\n"), err
    (out / "pytorch_model.bin").unlink()
    (out / "config.json").write_text("{}")
    assert main([str(tmp_path / "ckpt"), "--to", str(out), "--overwrite"]) == 0
    assert f"warning: export: {out / 'config.json'} stays as it is" in capsys.readouterr().err
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert all(torch.equal(v, sd[k]) for k, v in _read(out).items())
    # A config.json alone is refused too (it would not describe the export); so is an earlier export's folder.
    (out / "model.safetensors").unlink()
    for held in ("config.json", "model.safetensors"):
        assert main([str(tmp_path / "ckpt"), "--to", str(out)]) == 2
        assert f"already holds {held}: choose an empty folder, or give --overwrite" in capsys.readouterr().err
        (out / "config.json").unlink(missing_ok=True)
        assert main([str(tmp_path / "ckpt"), "--to", str(out), "--overwrite"]) == 0


def test_export_into_a_committed_checkpoint_step_is_refused(tmp_path, capsys):
    _checkpoint(tmp_path)
    step = tmp_path / "other" / "step-7"
    (step / "model_16bit").mkdir(parents=True)
    (step / "model_16bit" / "model.safetensors").write_text("its 16-bit weights")   # (refused as in a step)
    (step / "manifest.json").write_text("{}")
    for where in (step, step / "model_16bit"):
        assert main([str(tmp_path / "ckpt"), "--to", str(where)]) == 2
        err = capsys.readouterr().err
        assert err == f"error: export: {where} is in the committed checkpoint {step}: writing there would make it " \
                      f"differ from its manifest.json; choose a folder outside the checkpoint\n", err
    assert sorted(os.listdir(step)) == ["manifest.json", "model_16bit"]
    assert os.listdir(step / "model_16bit") == ["model.safetensors"]


def test_an_empty_to_is_refused_not_the_current_directory(tmp_path, capsys, monkeypatch):
    """--to "" would be the current directory, where the export replaces (deleting its shards) a model."""
    _checkpoint(tmp_path)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    (tmp_path / "model-00001-of-00002.safetensors").write_text("kept")
    before = sorted(os.listdir(tmp_path))
    assert main([str(tmp_path / "ckpt"), "--to", ""]) == 2
    assert capsys.readouterr().err == "error: export: the output folder is empty (''); name a folder\n"
    assert sorted(os.listdir(tmp_path)) == before


@pytest.mark.parametrize("loop", ["file .", "file ../ckpt", "link .", "link latest"])
def test_a_latest_that_loops_is_refused_in_one_line(tmp_path, capsys, loop):
    (tmp_path / "ckpt").mkdir()
    kind, target = loop.split()
    if kind == "file":
        (tmp_path / "ckpt" / "latest").write_text(target)
    else:
        (tmp_path / "ckpt" / "latest").symlink_to(target)
    assert main([str(tmp_path / "ckpt"), "--to", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: export: ") and err.count("\n") == 1, err
    assert err.endswith(("(a loop); point it at a step folder (e.g. step-100), or give the step folder itself\n",
                         "is a link that loops; point it at a step folder\n")), err


def test_export_to_fp16_counts_the_values_that_overflow(tmp_path, capsys):
    plain, _ = build_gpt(tiny_config(), seed=99)
    sd = {f"model.{k}": v.clone() for k, v in plain.state_dict().items()}
    big = next(k for k, v in sd.items() if v.numel() >= 2)
    sd[big].view(-1)[:2] = torch.tensor([1e6, 70000.0])
    _dcp_save(sd, tmp_path / "step-1")
    capsys.readouterr()
    assert main([str(tmp_path / "step-1"), "--to", str(tmp_path / "out"), "--dtype", "fp16"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("warning: export: 2 finite values beyond the float16 range"), err
    assert main([str(tmp_path / "step-1"), "--to", str(tmp_path / "out32")]) == 0
    assert capsys.readouterr().err == ""


def test_a_latest_link_to_the_newest_step_is_no_warning(tmp_path, capsys):
    """``latest`` may be a symbolic link to the step folder: named by its target, it agrees with the newest."""
    from framework.persist.export import resolve
    ckpt = tmp_path / "ckpt"
    for step in (2, 3):
        (ckpt / f"step-{step}").mkdir(parents=True)
        (ckpt / f"step-{step}" / "manifest.json").write_text(json.dumps({"format": 1, "files": {}, "seq": step}))
    for target in ("step-3", str(ckpt / "step-3")):
        (ckpt / "latest").unlink(missing_ok=True)
        (ckpt / "latest").symlink_to(target)
        assert resolve(ckpt) == ckpt / "step-3" and capsys.readouterr().err == ""
    (ckpt / "latest").unlink()
    (ckpt / "latest").symlink_to("step-2")
    assert resolve(ckpt) == ckpt / "step-3"
    assert "holds step-3, its newest committed checkpoint, but its latest names step-2" in capsys.readouterr().err
    # step 4 saved again, its commit under way (or killed) after moving the committed step-4 aside: read there
    (ckpt / "step-4.old").mkdir()
    (ckpt / "step-4.old" / "manifest.json").write_text(json.dumps({"format": 1, "files": {}, "seq": 4}))
    (ckpt / "step-4.tmp").mkdir()   # (no manifest yet: the new save is not complete)
    (ckpt / "latest").unlink()
    (ckpt / "latest").symlink_to("step-4")
    assert resolve(ckpt) == ckpt / "step-4.old" and capsys.readouterr().err == ""
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step-2", "step-3", "step-4.old", "step-4.tmp"]


class _Tied(torch.nn.Module):
    """An output projection sharing the embedding's matrix under its own name (as Hugging Face ties
    lm_head.weight to the input embedding)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 4, bias=False)
        self.head.weight = self.emb.weight
        self.emb.register_buffer("scale", torch.ones(4))   # a buffer two modules share, as the weight
        self.head.register_buffer("scale", self.emb.scale)

    def forward(self, x):
        return self.head(torch.tanh(self.emb(x)))


def test_fp32_state_dict_names_a_tied_parameter_under_each_name(tmp_path):
    """A checkpoint our save wrote records a tied parameter's (and a shared buffer's) other names: the fp32 state
    dict has it under each (one tensor, as DeepSpeed's get_fp32_state_dict_from_zero_checkpoint), and the plain
    model loads it with strict=True; the exported files hold it once (safetensors refuses shared tensors)."""
    import framework
    from framework.engine.step import Batch
    from framework.persist.checkpoint import Checkpointer

    cfg = framework.compose(["logger=none", "+stage=zero2", "train.steps=1"])
    torch.manual_seed(0)
    module = _Tied()
    with framework.initialize(module, lambda m, b: (m(b[0]) - b[1]).square().mean(), cfg) as engine:
        x = torch.randn(8, 4)
        state, _ = engine.train_step(engine.state, Batch(((x, x.flip(1)),)))
        ckpt = Checkpointer(cfg, engine, run_dir=tmp_path)
        ckpt.save(state)
        ckpt.close()
        trained = {n: t.detach().clone() for n, t in (engine.consolidated_state_dict() or {}).items()}
    step = next((tmp_path / "checkpoints").glob("step-*"))
    sd = get_fp32_state_dict_from_checkpoint(step)
    assert set(sd) == {"emb.weight", "emb.bias", "head.weight", "emb.scale", "head.scale"}
    assert sd["head.weight"] is sd["emb.weight"] and sd["head.scale"] is sd["emb.scale"]
    plain = _Tied()
    plain.load_state_dict(sd, strict=True)
    assert torch.equal(plain.head.weight, trained["emb.weight"])
    assert main([str(step), "--to", str(tmp_path / "out")]) == 0
    assert set(_read(tmp_path / "out")) == {"emb.weight", "emb.bias", "emb.scale"}


def test_non_finite_master_weights_are_refused_not_exported(tmp_path, capsys):
    """A save refuses a non-finite state, and resume refuses one found in a checkpoint: export does too, before
    any file is published (the output would hold NaN that load_weights refuses)."""
    plain, _ = build_gpt(tiny_config(), seed=99)
    sd = {f"model.{k}": v.clone() for k, v in plain.state_dict().items()}
    bad = next(k for k, v in sd.items() if v.numel() >= 2)
    sd[bad].view(-1)[1] = float("nan")
    _dcp_save(sd, tmp_path / "step-1")
    capsys.readouterr()
    assert main([str(tmp_path / "step-1"), "--to", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    assert f"non-finite values (NaN or inf) in '{bad.removeprefix('model.')}': not weights to export" in err, err
    assert not (tmp_path / "out").exists()


def test_an_inf_in_a_buffer_or_frozen_parameter_exports_and_a_nan_there_is_refused(tmp_path, capsys):
    """Saves and resume check buffers and frozen parameters for NaN only (an -inf there may be a causal mask every
    step holds): export does the same, so such a checkpoint exports as it trains and resumes."""
    plain, _ = build_gpt(tiny_config(), seed=99)
    sd = {f"model.{k}": v.clone() for k, v in plain.state_dict().items()}
    mask = torch.full((4, 4), float("-inf")).triu(1)
    frozen = torch.tensor([1.0, float("inf"), -2.0])
    _dcp_save({**sd, "buffer.mask": mask, "frozen.scale": frozen}, tmp_path / "step-1")
    assert main([str(tmp_path / "step-1"), "--to", str(tmp_path / "out")]) == 0
    out = _read(tmp_path / "out")
    assert torch.equal(out["mask"], mask) and torch.equal(out["scale"], frozen)
    mask[0, 0] = float("nan")
    _dcp_save({**sd, "buffer.mask": mask}, tmp_path / "step-2")
    capsys.readouterr()
    assert main([str(tmp_path / "step-2"), "--to", str(tmp_path / "out2")]) == 1
    err = capsys.readouterr().err.strip()
    assert "non-finite values (NaN or inf) in 'mask'" in err and "\n" not in err, err
    assert not (tmp_path / "out2").exists()


def test_latest_naming_another_step_is_said_once_per_export(tmp_path, capsys):
    """A folder whose ``latest`` names a step it no longer holds: the export says once which step it exports."""
    from framework.persist import stepfolders
    _checkpoint(tmp_path)
    step = tmp_path / "ckpt" / "step-3"   # committed, as a save leaves it
    stepfolders.write_manifest(step, {n: stepfolders.file_entry(step, n) for n in stepfolders.files_of(step)},
                               step=3, world=1, stage=None, config_hash="x", verified=True, seq=1)
    (tmp_path / "ckpt" / "latest").write_text("step-9\n")
    capsys.readouterr()
    assert main([str(tmp_path / "ckpt"), "--to", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err.splitlines()
    said = [x for x in err if "but its latest names step-9; exporting step-3" in x]
    assert len(said) == 1, err
