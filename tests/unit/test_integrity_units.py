"""Integrity pieces on one process: planted links refused by name in every folder the framework
writes, strict swap-extent checks, disk room summed per file system, a stopped rank named,
rendezvous folders of dead runs removed (never a live one's), non-finite numbers in configs."""
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from framework import ConfigError, compose
from framework.core.errors import CheckpointError, DistributedError, FrameworkError, SwapIOError, UnsafePathError
from framework.core.files import (create_new, make_dir, make_dirs, open_append, read_into, temp_name, write_at,
                                  write_atomic)
from framework.core.room import Claim, check_name, nearest_existing, shortfalls


# --- planted links --------------------------------------------------------------------------------

def _plant(tmp_path: Path, name: str) -> tuple[Path, Path]:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    link = tmp_path / name
    link.symlink_to(victim)
    return link, victim


def test_safe_opens_refuse_links_and_make_private_files_and_folders(tmp_path):
    link, victim = _plant(tmp_path, temp_name("latest"))
    with pytest.raises(UnsafePathError, match=rf"^{link} is a symbolic link; refusing to follow it"):
        write_atomic(tmp_path / "latest", b"step-2")
    with pytest.raises(UnsafePathError, match="is a symbolic link"):
        create_new(link)
    with pytest.raises(UnsafePathError, match="is a symbolic link"):
        open_append(link)
    assert victim.read_text() == "precious" and not (tmp_path / "latest").exists()
    dead = subprocess.Popen(["true"])
    dead.wait()   # (a pid no process has now)
    for name in ("stale.tmp", temp_name("stale").replace(f".{os.getpid()}.", f".{dead.pid}."), temp_name("stale")):
        (tmp_path / name).write_text("left by a killed run")
    write_atomic(tmp_path / "unswept", b"r", sweep=False)   # (only its own temporary looked for: nothing listed)
    assert len(list(tmp_path.glob("stale.*"))) == 3
    (tmp_path / temp_name("unswept")).write_text("this process's, left by an interrupted write")
    write_atomic(tmp_path / "unswept", b"r2", sweep=False)
    assert (tmp_path / "unswept").read_bytes() == b"r2" and not (tmp_path / temp_name("unswept")).exists()
    (tmp_path / temp_name("stale").replace(f".{os.getpid()}.", f".{os.getppid()}.")).write_text("a live writer's")
    write_atomic(tmp_path / "stale", b"new")            # stale regular temporaries are removed, a live one's kept
    assert (tmp_path / "stale").read_bytes() == b"new"
    assert [p.name for p in tmp_path.glob("stale.*")] == [temp_name("stale").replace(f".{os.getpid()}.",
                                                                                        f".{os.getppid()}.")]
    assert (tmp_path / "stale").stat().st_mode & 0o777 == 0o600
    old = os.umask(0o022)   # a shared record (Hydra's .hydra/ files): the umask's mode, links still refused
    try:
        write_atomic(tmp_path / "record", b"r", shared=True)
        with pytest.raises(UnsafePathError, match="is a symbolic link"):
            write_atomic(tmp_path / "latest", b"step-2", shared=True)
    finally:
        os.umask(old)
    assert (tmp_path / "record").stat().st_mode & 0o777 == 0o644 and victim.read_text() == "precious"
    (tmp_path / "folder").mkdir()
    with pytest.raises(IsADirectoryError):              # a failed rename leaves no temporary behind
        write_atomic(tmp_path / "folder", b"data")
    assert not list(tmp_path.glob("folder*.tmp"))
    old = os.umask(0o022)
    try:
        make_dirs(tmp_path / "a" / "b" / "c")
    finally:
        os.umask(old)
    for p in (tmp_path / "a", tmp_path / "a" / "b", tmp_path / "a" / "b" / "c"):
        assert p.stat().st_mode & 0o777 == 0o700, p


def test_two_processes_rewriting_one_file_never_take_each_others_temporary(tmp_path):
    """Ranks of a sweep (or Slurm tasks) writing one record at once: each through its own temporary, no error,
    the file whole, no temporary left (about 1 s)."""
    path, data = tmp_path / "multirun.yaml", b"x: 1\n" * 200
    pids = []
    for _ in range(2):
        if (pid := os.fork()) == 0:   # (a child: a loop of writes, its status the errors it met)
            errors = 0
            for _ in range(300):
                try:
                    write_atomic(path, data, shared=True)
                except OSError:
                    errors += 1
            os._exit(min(errors, 100))
        pids.append(pid)
    assert [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids] == [0, 0]
    assert path.read_bytes() == data and sorted(os.listdir(tmp_path)) == ["multirun.yaml"]


def test_a_planted_link_in_the_checkpoint_folder_is_refused(tmp_path):
    """``latest.tmp`` and a ``step-N.tmp`` folder planted as links: the commit protocol refuses them
    by name and never writes through them."""
    from framework.persist import stepfolders

    root = tmp_path / "ckpt"
    root.mkdir()
    link, victim = _plant(root, temp_name("latest"))
    tmp = root / "step-1.tmp"
    tmp.mkdir()
    (tmp / stepfolders.MANIFEST).write_text(json.dumps({"format": 1, "files": {}}))
    with pytest.raises(UnsafePathError, match=rf"{link} is a symbolic link"):
        stepfolders.commit(tmp, root / "step-1", lambda point: None)
    assert victim.read_text() == "precious" and tmp.is_dir() and not (root / "step-1").exists()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (root / "step-2.tmp").symlink_to(elsewhere)
    stepfolders.remove_stale(root)                          # links are left alone, never deleted through
    with pytest.raises(UnsafePathError, match="step-2.tmp is a symbolic link"):
        make_dir(root / "step-2.tmp", exist_ok=False)   # how a save makes its step folder
    assert elsewhere.is_dir() and not list(elsewhere.iterdir())


# (the temporary's name holds this process's id: made in the test, so that every xdist worker collects one name)
@pytest.mark.parametrize("name", ["rank00000.optim.swap", "rank00000.optim.swap.manifest.json", "temporary"])
def test_a_planted_link_in_the_nvme_folder_is_refused(tmp_path, name):
    from framework.offload._swapfile import SwapFile, swap_path

    if name == "temporary":
        name = temp_name("rank00000.optim.swap.manifest.json")
    link, victim = _plant(tmp_path, name)
    with pytest.raises(UnsafePathError, match=rf"^{link} is a symbolic link"):
        SwapFile.create(swap_path(tmp_path, 0, "optim"), {"a": 4096}, layout_hash="h", world_size=1, rank=0,
                        dtype=torch.float32)
    assert victim.read_text() == "precious"


def test_run_outputs_and_exports_refuse_planted_links(tmp_path):
    from framework.loggers._base import RunRecord
    from framework.persist.tensorfiles import create_files, plan_files

    link, victim = _plant(tmp_path, "metrics.jsonl")
    with pytest.raises(UnsafePathError, match="metrics.jsonl is a symbolic link"):
        RunRecord(tmp_path)
    out = tmp_path / "export"
    out.mkdir()
    plans = plan_files([("w", (2, 2), torch.float32)], "5GB")
    (out / f"{plans[0].name}.tmp").symlink_to(victim)   # removed (a link, never followed) and made anew
    with create_files(out, plans):
        assert victim.read_text() == "precious" and not (out / f"{plans[0].name}.tmp").is_symlink()


def test_rotation_never_deletes_the_newest_verified_checkpoint(tmp_path):
    """keep_last=1 after a commit of step 3 whose save could not vouch for its state (no ``verified``
    flag: an older framework's, or a folder made by hand): step 1, the newest verified one, stays;
    the folders go through ``step-N.del`` and are gone."""
    from framework.persist import stepfolders

    for step, verified in ((1, True), (2, None), (3, None)):
        folder = tmp_path / f"step-{step}"
        folder.mkdir()
        body = {"format": 1, "files": {}, **({"verified": True} if verified else {})}
        (folder / stepfolders.MANIFEST).write_text(json.dumps(body))
    gone, left = stepfolders.prune(tmp_path, tmp_path / "step-3", keep_last=1)
    assert [p.name for p in gone] == ["step-2"] and left == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1", "step-3"]


def test_rotation_never_deletes_a_checkpoint_whose_manifest_it_cannot_read(tmp_path):
    """A committed folder whose manifest does not parse (a newer framework's format, unreadable for now) is of
    unknown state: keep_last passes it over, deleting only the older readable ones."""
    from framework.persist import stepfolders

    for step, fmt in ((1, 1), (2, 2), (3, 1), (4, 1)):
        folder = tmp_path / f"step-{step}"
        folder.mkdir()
        (folder / stepfolders.MANIFEST).write_text(json.dumps({"format": fmt, "files": {}, "verified": True}))
    gone, left = stepfolders.prune(tmp_path, tmp_path / "step-4", keep_last=1)
    assert [p.name for p in gone] == ["step-3", "step-1"] and left == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2", "step-4"]


def test_rotation_says_which_folder_it_could_not_delete(tmp_path, monkeypatch):
    """A deletion that leaves files behind (one held open on a network file system, no permission) leaves
    ``step-1.del``: prune names it as left, not as deleted, and the next save's clean-up tries again."""
    import shutil

    from framework.persist import stepfolders

    for step in (1, 2):
        (tmp_path / f"step-{step}").mkdir()
        (tmp_path / f"step-{step}" / stepfolders.MANIFEST).write_text(
            json.dumps({"format": 1, "files": {}, "verified": True}))
    rmtree = shutil.rmtree
    monkeypatch.setattr(shutil, "rmtree", lambda p, **kw: None if Path(p).name == "step-1.del" else rmtree(p, **kw))
    gone, left = stepfolders.prune(tmp_path, tmp_path / "step-2", keep_last=1)
    assert gone == [] and [p.name for p in left] == ["step-1.del"]
    monkeypatch.undo()
    stepfolders.remove_stale(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2"]


@pytest.mark.parametrize("complete", [True, False])
def test_a_save_killed_inside_its_commit_loses_no_checkpoint(tmp_path, capsys, complete):
    """Killed while saving a step again, between moving step-4 aside (step-4.old) and renaming step-4.tmp in: the
    next save's clean-up puts step-4 back (the new one when its manifest was written, else the old one) before
    it removes what is left, with one line saying so; ``latest`` names a folder that exists. A reader's scan
    finds the same one where it lies."""
    from framework.persist import stepfolders
    for name, body in (("step-4.old", "old"), ("step-4.tmp", "new")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "x").write_text(body)
    if complete:
        (tmp_path / "step-4.tmp" / stepfolders.MANIFEST).write_text(json.dumps({"format": 1, "files": {}}))
    (tmp_path / "step-4.old" / stepfolders.MANIFEST).write_text(json.dumps({"format": 1, "files": {}}))
    (tmp_path / "step-2.del").mkdir()
    (tmp_path / "latest").write_text("step-4")
    # a reader (another run's folder, whose commit may be under way) finds step-4 where it lies, renaming nothing
    before = sorted(os.listdir(tmp_path))
    assert stepfolders.scan(tmp_path, around=True)[0] == [tmp_path / ("step-4.tmp" if complete else "step-4.old")]
    assert stepfolders.scan(tmp_path)[0] == [] and sorted(os.listdir(tmp_path)) == before
    stepfolders.remove_stale(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-4"]
    assert (tmp_path / "step-4" / "x").read_text() == ("new" if complete else "old")
    said = capsys.readouterr().out.splitlines()
    assert len(said) == 1 and said[0].startswith(f"checkpoint: {tmp_path / 'step-4'} was missing"), said
    stepfolders.remove_stale(tmp_path)   # nothing more to do: nothing said
    assert capsys.readouterr().out == "" and sorted(os.listdir(tmp_path)) == ["latest", "step-4"]


def test_a_complete_tmp_of_a_first_save_is_removed_not_restored(tmp_path, capsys):
    """Killed after writing step-4.tmp's manifest but before its rename, with no step-4 moved aside: the resume
    passes it over (it goes on from step-2), so the next save's clean-up removes it, silently, rather than
    restoring it under a line that reads as if step-4 had been resumed (with another checkpoint.every, a
    checkpoint of the abandoned run beside the new run's)."""
    from framework.persist import stepfolders

    for name in ("step-2", "step-4.tmp"):
        (tmp_path / name).mkdir()
        stepfolders.write_manifest(tmp_path / name, {})
    (tmp_path / "latest").write_text("step-2")
    assert stepfolders.scan(tmp_path, around=True)[0] == [tmp_path / "step-2"]
    stepfolders.remove_stale(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-2"] and capsys.readouterr().out == ""


def test_resume_order_is_the_commit_order_not_the_step(tmp_path):
    """``scan`` lists the newest commit first: a run rewound to an older step goes on from its own
    newest save (step-2 committed after step-6), not from the abandoned higher steps; manifests without ``seq``
    (written before it existed) keep the step order, below every numbered commit."""
    from framework.persist import stepfolders

    for step, seq in ((2, 4), (4, 2), (6, 3), (8, None), (10, None)):
        folder = tmp_path / f"step-{step}"
        folder.mkdir()
        (folder / stepfolders.MANIFEST).write_text(json.dumps({"format": 1, "files": {}, "seq": seq}))
    assert [p.name for p in stepfolders.scan(tmp_path)[0]] == ["step-2", "step-6", "step-4", "step-10", "step-8"]
    assert stepfolders.next_seq(tmp_path) == 5 and stepfolders.next_seq(tmp_path / "none") == 1


def test_a_manifest_altered_where_it_still_parses_is_damage_tried_last(tmp_path):
    """A flipped bit in a manifest's ``seq`` (4 -> 6) still parses and passes every file check, and would make the
    resume pick that older step over the newer one: the manifest's checksum of its own body makes it damage,
    named in a note and tried last. A manifest without that checksum (written before it) is read as before."""
    from framework.persist import stepfolders

    for step, seq in ((8, 4), (10, 5)):
        (tmp_path / f"step-{step}").mkdir()
        stepfolders.write_manifest(tmp_path / f"step-{step}", {}, step=step, seq=seq)
    path = tmp_path / "step-8" / stepfolders.MANIFEST
    path.write_text(path.read_text().replace('"seq": 4', '"seq": 6'))
    found, notes = stepfolders.scan(tmp_path)
    assert [p.name for p in found] == ["step-10", "step-8"]
    assert len(notes) == 1 and "step-8" in notes[0] and "does not match its own sha256" in notes[0], notes
    with pytest.raises(CheckpointError, match="does not match its own sha256 checksum"):
        stepfolders.read_manifest(tmp_path / "step-8")
    older = {"format": 1, "files": {}, "seq": 6}   # no checksum of its own: an older version's manifest
    path.write_text(json.dumps(older))
    assert stepfolders.read_manifest(tmp_path / "step-8") == older
    assert [p.name for p in stepfolders.scan(tmp_path)[0]] == ["step-8", "step-10"]


# --- strict swap-extent checks ----------------------------------------------------------------------

def test_a_mapped_extent_is_verified_byte_for_byte_or_refused(tmp_path):
    """Every byte of an extent must lie in a piece whose checksum was recorded: a changed byte and
    bytes without a checksum are both SwapIOErrors naming the file and the offset."""
    from framework.offload._aio import AsyncIO, verify_map
    from framework.offload._swapfile import SwapFile

    with SwapFile.create(tmp_path / "s.swap", {"a": 8192, "b": 4096}, layout_hash="h", world_size=1, rank=0,
                         dtype=torch.float32) as f, AsyncIO(4096, 2, 1) as io:
        for name in ("a", "b"):
            offset, nbytes = f.extent(name)
            io.pwrite(f, offset, torch.arange(nbytes // 4, dtype=torch.float32), name).wait()
        verify_map(f.map(write=False))
        f.record(None, *f.extent("b"), None)          # "b" has no checksum any more
        with pytest.raises(SwapIOError, match=r"no checksum recorded at offset 8192 \(4096 bytes, extent 'b'"):
            verify_map(f.map(write=False))
        io.pwrite(f, f.extent("b")[0], torch.zeros(1024), "b").wait()
        with open(f.path, "r+b") as raw:
            raw.seek(4100)
            raw.write(b"\x01")
        with pytest.raises(SwapIOError, match=rf"swap file {f.path}: checksum mismatch at offset 4096"):
            verify_map(f.map(write=False))


def test_a_truncated_swap_file_is_a_swap_error_not_a_mapping_crash(tmp_path):
    """A swap file shortened outside the run (mmap refuses a length past the end) is one SwapIOError naming the
    file and its size against the expected one, as the training path's short read is."""
    from framework.offload._swapfile import SwapFile

    with SwapFile.create(tmp_path / "s.swap", {"a": 8192, "b": 4096}, layout_hash="h", world_size=1, rank=0,
                         dtype=torch.float32) as f:
        os.truncate(f.path, 8192)
        for write in (False, True):
            with pytest.raises(SwapIOError, match=rf"swap file {f.path}: short file: 8192 of 12288 bytes") as e:
                f.map(write=write)
            assert e.value.path == str(f.path)


# --- room summed per file system ------------------------------------------------------------------

def test_room_is_summed_over_the_ranks_sharing_a_file_system(tmp_path):
    mib = 1 << 20
    same = [Claim(r, "h", 7, 10 * mib, 6 * mib, str(tmp_path)) for r in range(2)]
    other = [Claim(2, "h", 8, 10 * mib, 6 * mib, "/elsewhere"), Claim(3, "g", 7, 10 * mib, 6 * mib, "/x")]
    (short,) = shortfalls(same + other)
    assert short.ranks == (0, 1) and short.need == 12 * mib
    assert short.describe("the swap files").startswith(f"{tmp_path}: the swap files of ranks 0, 1, sharing this "
                                                        "file system, need 12.00 MiB")
    assert shortfalls(same[:1] + other) == []
    assert Claim.of(tmp_path / "not" / "yet", 5).free > 0   # a folder about to be made: its parent's room


def test_a_folder_to_make_through_a_dangling_link_or_with_too_long_a_name_is_one_line(tmp_path):
    """The run folder's check: a link to nothing (Hydra's makedirs: FileExistsError) and a name the kernel refuses
    (ENAMETOOLONG from pathlib) are one line naming the setting; a 255-byte part and an existing link are fine."""
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    for folder in (tmp_path / "dangling", tmp_path / "dangling" / "sub"):
        with pytest.raises(ConfigError) as e:
            nearest_existing(folder, "hydra.run.dir")
        assert str(e.value) == (f"hydra.run.dir={folder}: {tmp_path / 'dangling'} is a link to a missing folder "
                                f"({tmp_path / 'nowhere'}); make that folder or set hydra.run.dir to another")
    assert nearest_existing(tmp_path / "dangling") == tmp_path   # (no key: the room where it would be made)
    (tmp_path / "nowhere").mkdir()
    assert nearest_existing(tmp_path / "dangling" / "sub", "k") == tmp_path / "dangling"
    part, deep = "ü" * 128, "/".join(["d" * 200] * 21)   # 256 bytes; over 4095 bytes in all
    with pytest.raises(ConfigError) as e:
        nearest_existing(tmp_path / part / "x", "offload.nvme_path")
    assert str(e.value) == (f"offload.nvme_path={tmp_path / part / 'x'}: its part {'ü' * 8}... is 256 bytes, over "
                            "the 255 a file name may have; set offload.nvme_path to a shorter path")
    with pytest.raises(ConfigError, match=r"^k=.*: it is \d+ bytes long \(made absolute\), over the 4095 a path may "
                                          "have; set k to a shorter path$"):
        check_name(tmp_path / deep, "k")
    assert nearest_existing(tmp_path / ("b" * 255) / "x", "k") == tmp_path
    # The checkpoint pre-flight checks its two paths first (before: ENAMETOOLONG from its scan, a traceback).
    from framework.persist.checkpoint import preflight
    for key in ("checkpoint.dir", "checkpoint.resume"):
        with pytest.raises(ConfigError, match=rf"^{key}=.*: its part {'ü' * 8}\.\.\. is 256 bytes, over the 255 "
                                              rf"a file name may have; set {key} to a shorter path$"):
            preflight(compose([f"{key}='{tmp_path / part / 'x'}'", "checkpoint.every=0"]), tmp_path)


def test_free_note_says_the_free_space_or_what_is_given_where_it_cannot_be_asked(tmp_path, monkeypatch):
    from framework.core import room
    note = room.free_note(tmp_path / "not" / "yet", "; {} free")   # a folder about to be made: its parent's room
    assert note.startswith("; ") and note.endswith(" bytes) free"), note

    def fail(path):
        raise PermissionError(13, "Permission denied", str(path))
    monkeypatch.setattr(room.os, "statvfs", fail)
    assert room.free_note(tmp_path) == "" and room.free_note(tmp_path, unknown="free space unknown") == \
        "free space unknown"


# --- a stalled rank is named ----------------------------------------------------------------------

def test_a_stopped_or_dead_peer_is_named():
    from framework.comm.distributed import Dist

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    try:
        os.kill(child.pid, signal.SIGSTOP)
        for _ in range(100):   # the stop is asynchronous
            with open(f"/proc/{child.pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "T":
                    break
            time.sleep(0.01)
        host = socket.gethostname()
        dist = Dist(0, 3, 0, torch.device("cpu"), "gloo", 3.0,
                    peers=((host, os.getpid()), (host, child.pid), (host, gone.pid)))
        assert dist.who_failed() == (f"rank 2 lost (process gone); rank 1 stalled (pid {child.pid} is stopped "
                                     "(SIGSTOP or SIGTSTP: send SIGCONT, or kill it))")
    finally:
        child.kill()
        child.wait()


def test_a_collective_failed_by_a_lost_peer_names_it_alone():
    """A peer whose process is gone closed its connections: the collective failed then, so the line says who and
    during what, not a wait up to the timeout that did not happen, nor the backend's own text."""
    from framework.comm.distributed import Dist
    from framework.core.errors import DistributedError

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    host = socket.gethostname()
    dist = Dist(0, 2, 0, torch.device("cpu"), "gloo", 1800.0, peers=((host, os.getpid()), (host, gone.pid)))

    def closed():
        raise RuntimeError("[../third_party/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                           "[127.0.0.1]:3218. This is typically caused by a remote worker crashing. GLHF!")
    with pytest.raises(DistributedError) as e:
        dist._run("checkpoint writing the files", closed, limit=(1800.0, "checkpoint.timeout_s"))
    assert str(e.value) == "rank 0/2: rank 1 lost (process gone) during checkpoint writing the files"


def test_a_peer_still_exiting_is_named_once_gone():
    """A crashed rank's sockets close while its process is still ending: the survivor's failed collective
    waits for it to be gone and names it, rather than "a peer rank died or stalled"."""
    from framework.comm.distributed import Dist

    code = ("import atexit, sys, time\n"
            "atexit.register(lambda: (print('exiting', flush=True), time.sleep(0.2)))\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "exiting\n"   # inside its exit path, not yet gone
        host = socket.gethostname()
        dist = Dist(0, 2, 0, torch.device("cpu"), "gloo", 3.0, peers=((host, os.getpid()), (host, child.pid)))
        assert dist.who_failed(settle_s=30.0) == "rank 1 lost (process gone)"
    finally:
        child.kill()
        child.wait()


def test_proc_stat_is_read_past_the_command_name():
    """The command name may hold spaces and parentheses; flags (field 9) carry the kernel's
    PF_EXITING (0x4) for a process inside exit, which counts as gone."""
    from framework.comm.distributed import parse_stat

    line = "4242 (py (x) ) y)) R 1 4242 4242 0 -1 4194628 120 0 0 0 3 1 0 0 20 0 1 0\n"
    assert parse_stat(line) == ("R", 4194628)
    assert parse_stat(line)[1] & 0x4


# --- rendezvous folders of dead runs --------------------------------------------------------------

def test_rendezvous_folders_of_dead_runs_are_removed_and_live_ones_kept(tmp_path):
    from framework.cli._rendezvous import LOCK as RDZV_LOCK, PREFIX as RDZV_PREFIX, remove_dead

    old = time.time() - 7200

    def folder(name, lock=True):
        d = tmp_path / f"{RDZV_PREFIX}{name}"
        d.mkdir()
        if lock:
            (d / RDZV_LOCK).write_text("")
        os.utime(d, (old, old))
        return d

    dead, legacy, live = folder("dead"), folder("legacy", lock=False), folder("live")
    young = tmp_path / f"{RDZV_PREFIX}young"
    young.mkdir()
    other = tmp_path / "framework-pool-x"
    other.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time\n"
                               f"fd = os.open({str(live / RDZV_LOCK)!r}, os.O_RDWR)\n"
                               "fcntl.flock(fd, fcntl.LOCK_SH)\nprint('held', flush=True)\ntime.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        os.utime(live, (old, old))
        gone = remove_dead(str(tmp_path))
    finally:
        holder.kill()
        holder.wait()
    assert sorted(gone) == sorted([str(dead), str(legacy)])
    assert live.is_dir() and young.is_dir() and other.is_dir()


def test_a_rendezvous_folder_removed_meanwhile_is_skipped(tmp_path, monkeypatch):
    """Another launch's clean-up removes a folder between the listing and its stat: skipped, the
    others still handled (it used to end the launch with an UnboundLocalError)."""
    import framework.cli._rendezvous as rdzv

    old = time.time() - 7200
    folders = [tmp_path / f"{rdzv.PREFIX}{name}" for name in ("a-vanished", "b-dead")]
    for d in folders:
        d.mkdir()
        (d / rdzv.LOCK).write_text("")
        os.utime(d, (old, old))
    listed = sorted(os.scandir(tmp_path), key=lambda e: e.name)
    (folders[0] / rdzv.LOCK).unlink()
    folders[0].rmdir()
    scandir = os.scandir
    monkeypatch.setattr(os, "scandir", lambda where: iter(listed) if where == str(tmp_path) else scandir(where))
    assert rdzv.remove_dead(str(tmp_path)) == [str(folders[1])]


# --- numbers in configs ---------------------------------------------------------------------------

@pytest.mark.parametrize("override,message", [
    ("train.grad_clip=nan", "config: train.grad_clip=nan is not a finite number"),
    ("train.grad_clip=1e309", "config: train.grad_clip=inf is not a finite number"),
    ("optimizer.lr=inf", "config: optimizer.lr=inf is not a finite number"),
    ("checkpoint.timeout_s=nan", "config: checkpoint.timeout_s=nan is not a finite number"),
    ("train.micro_batch=100000000000000000000000", "config: train.micro_batch=100000000000000000000000 is out of "
                                                   "range"),
    ("train.on_nonfinite=ignore", "config: train.on_nonfinite must be stop or warn, got 'ignore'"),
])
def test_non_finite_and_overflowing_numbers_are_one_line_errors(override, message):
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(".", r"\.")):
        compose([override])


@pytest.mark.parametrize("ds,message", [
    ('{"gradient_clipping": NaN}', "ds_config: gradient_clipping must be a finite number, got NaN"),
    ('{"gradient_clipping": 1e309}', "ds_config: gradient_clipping must be a finite number, got Infinity"),
    ('{"train_micro_batch_size_per_gpu": 1e23}', "ds_config: train_micro_batch_size_per_gpu=1e+23 is out of range"),
    ('{"train_batch_size": 100000000000000000000000}', "ds_config: train_batch_size=100000000000000000000000 is out "
                                                       "of range"),
])
def test_deepspeed_numbers_that_are_not_finite_or_overflow_are_one_line_errors(tmp_path, ds, message):
    path = tmp_path / "ds.json"
    path.write_text(ds)
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace("+", r"\+")):
        compose([f"ds_config={path}"])


# --- a failed checkpoint read: one path for every rank ------------------------------------------------

class _Sent(Exception):
    pass


class _Gather:
    """A checkpoint group of ``world`` ranks seen from ``rank``: first records what this rank sends
    (``_Sent``), then answers with what every rank sent."""

    def __init__(self, rank, world, everyone=None):
        self.rank, self.world, self.everyone = rank, world, everyone

    def all_gather(self, obj, what):
        if self.everyone is None:
            raise _Sent(obj)
        return self.everyone

    all_gather_object = all_gather   # (a ``Dist`` for ``agree``)


def _agreed(outcomes, agree=None):
    """What ``agree_load`` (or ``agree``) raises on each rank when rank r's ``fn`` raises ``outcomes[r]`` (None:
    succeeds)."""
    from framework.persist.checkpoint._group import agree_load
    agree_load = agree or agree_load

    def fn(e):
        def run():
            if e is not None:
                raise e
            return "loaded"
        return run

    sent = []
    for r, e in enumerate(outcomes):
        with pytest.raises(_Sent) as got:
            agree_load(_Gather(r, len(outcomes)), "reading", fn(e))
        sent.append(got.value.args[0])
    raised = []
    for r, e in enumerate(outcomes):
        with pytest.raises(BaseException) as got:
            agree_load(_Gather(r, len(outcomes), sent), "reading", fn(e))
        raised.append(got.value)
    return raised


@pytest.mark.parametrize("outcomes,falls_back,config", [
    ([None, CheckpointError("damaged"), None], True, False),
    ([RuntimeError("dcp"), None], True, False),
    ([CheckpointError("damaged"), SwapIOError("swap read failed"), None], False, False),
    ([None, SwapIOError("swap read failed"), CheckpointError("damaged")], False, False),
    ([ConfigError("another model"), CheckpointError("damaged"), None], False, True),
])
def test_after_a_failed_read_every_rank_takes_the_same_path(outcomes, falls_back, config):
    """``Checkpointer.resume`` falls back on a CheckpointError and stops on any other error: every
    rank must raise the same kind, or some would go on to the next folder's collectives while the
    others left (a hang until the timeout)."""
    raised = _agreed(outcomes)
    assert all(isinstance(e, FrameworkError) for e in raised), raised
    assert [isinstance(e, CheckpointError) for e in raised] == [falls_back] * len(raised), raised
    assert [isinstance(e, ConfigError) for e in raised] == [config] * len(raised), raised


@pytest.mark.parametrize("how,outcomes,every", [
    ("agree", [None, ConfigError("run folder in use")], True),
    ("agree", [RuntimeError("bug"), None], False),   # (rank 0's own: the others' FrameworkError is not marked either)
    ("agree", [DistributedError("gone"), ConfigError("refused")], False),
    ("load", [ConfigError("another model"), CheckpointError("damaged"), None], True),
    ("load", [None, SwapIOError("swap read failed")], True),
    ("load", [ConfigError("another model"), DistributedError("rank 1/2: all_gather timed out")], False),
    ("save", [CheckpointError("disk full"), None], True),
])
def test_an_agreed_outcome_marks_every_ranks_error_alike(tmp_path, how, outcomes, every):
    """Under torchrun a sweep's ranks go on to the next job together only after a FrameworkError every rank
    raised alike (``every_rank``): the outcomes ``agree``, ``agree_load`` and ``agree_save`` exchanged; marked on
    every rank or on none, so no rank goes on alone while its peers end the sweep."""
    from framework.comm.distributed import agree
    from framework.persist.checkpoint._group import agree_save
    raised = _agreed(outcomes, {"agree": lambda group, what, fn: agree(group, fn, what), "load": None,
                                "save": lambda group, what, fn: agree_save(group, what, fn, tmp_path / "s.tmp")}[how])
    assert [getattr(e, "every_rank", False) for e in raised] == [every] * len(outcomes), raised


@pytest.mark.parametrize("dcp_wrapped,more", [(True, False), (False, True)])
def test_one_full_disk_reported_by_every_rank_is_said_once(tmp_path, monkeypatch, dcp_wrapped, more):
    """DCP raises rank 1's ENOSPC on every rank, and each rank measures the free bytes at its own moment: on a
    busy disk two numbers for one cause, which once read as "(and 1 more rank)" (a CI flake). One failure is
    said once, in one rank's words, the same on every rank; two ranks' own failures are still both counted."""
    from torch.distributed.checkpoint.api import CheckpointException

    from framework.persist.checkpoint import _group
    from framework.persist.checkpoint._group import agree_save
    moments = iter(range(100))
    monkeypatch.setattr(_group, "free_note", lambda *a, **k: f"{next(moments)} bytes free")
    full = OSError(errno.ENOSPC, "No space left on device")
    outcome = CheckpointException("write", {1: (full, [])}) if dcp_wrapped else full
    raised = _agreed([outcome, outcome], lambda group, what, fn: agree_save(group, what, fn, tmp_path / "step-3.tmp"))
    assert all(isinstance(e, CheckpointError) for e in raised) and len({str(e) for e in raised}) == 1, raised
    assert ("more rank" in str(raised[0])) == more, raised[0]
    assert str(raised[0]).startswith("checkpoint: saving step-3 failed (reading): " +
                                     ("rank 1: " if dcp_wrapped else "rank 0: ")), raised[0]


def _dcp_stopped(stop):
    """A CheckpointException as DCP raises it on every rank when rank 1's reader or writer raised ``stop``."""
    from torch.distributed.checkpoint.api import CheckpointException
    return CheckpointException("read", {1: (stop, [])})


@pytest.mark.parametrize("save", [False, True])
@pytest.mark.parametrize("stop", [KeyboardInterrupt(), SystemExit(143)])
def test_an_interrupt_inside_a_checkpoint_read_or_write_stops_every_rank(tmp_path, stop, save):
    """Ctrl-C or SIGTERM while DCP reads or writes (it wraps whatever its reader or writer raised, these too)
    is neither a damaged checkpoint (no fallback to an older one) nor a failed save: every rank raises the
    interrupt (the loop's one line, 130/143), whatever the others' own outcome."""
    from framework.persist.checkpoint._group import agree_save
    tmp = tmp_path / "step-2.tmp"
    raised = _agreed([_dcp_stopped(stop), CheckpointError("damaged"), None],
                     (lambda group, what, fn: agree_save(group, what, fn, tmp)) if save else None)
    assert [type(e) for e in raised] == [type(stop)] * 3, raised
    assert all(getattr(e, "code", None) == getattr(stop, "code", None) for e in raised), raised


@pytest.mark.parametrize("save", [False, True])
@pytest.mark.parametrize("stop", [KeyboardInterrupt(), SystemExit(143)])
def test_an_exchange_failed_by_an_interrupted_peer_raises_this_ranks_own_interrupt(tmp_path, stop, save):
    """A peer interrupted inside the outcomes' exchange fails it here (DistributedError): this rank's own
    interrupt is raised, not a false "a peer rank died or stalled"."""
    from framework.persist.checkpoint._group import agree_load, agree_save

    class Failing(_OneRank):
        def all_gather(self, obj, what):
            raise DistributedError(f"{what} failed after waiting up to 1800s (a peer rank died or stalled)")

    def fn():
        raise _dcp_stopped(stop)

    tmp = tmp_path / "step-2.tmp"
    with pytest.raises(BaseException) as got:
        agree_save(Failing(), "writing the files", fn, tmp) if save else agree_load(Failing(), "reading", fn)
    assert type(got.value) is type(stop) and getattr(got.value, "code", None) == getattr(stop, "code", None)
    with pytest.raises(DistributedError):   # (nothing to stop for: the peer's failure is named)
        agree_save(Failing(), "writing the files", lambda: None, tmp) if save else \
            agree_load(Failing(), "reading", lambda: None)


class _OneRank:
    rank, world = 0, 1

    def all_gather(self, obj, what):
        return [obj]


@pytest.mark.parametrize("case", ["no room", "cannot inspect", "non-finite", "copies differ", "damaged", "folder"])
def test_a_checkpoint_refused_from_exchanged_outcomes_is_marked_as_every_ranks(tmp_path, monkeypatch, case):
    """A save refused before it wrote (no room, a folder it cannot inspect, non-finite state, replicated copies
    that differ between ranks), a damaged
    checkpoint or a checkpoint.dir rank 0 cannot write is decided from outcomes every rank holds: each rank raises it alike (``every_rank``), so that a
    torchrun sweep's ranks go on to the next job together."""
    import types
    from framework.persist import checkpoint, stepfolders
    from framework.persist.checkpoint import _save
    from framework.persist.checkpoint._load import verify

    if case == "folder":   # rank 0 could not write checkpoint.dir: rank 1 hears it
        dist = types.SimpleNamespace(rank=1, world=2, all_gather_object=lambda obj, what: [("t", "not writable")])
        with pytest.raises(ConfigError, match="not writable") as got:
            checkpoint.shared(dist, tmp_path)
    elif case == "damaged":
        (tmp_path / stepfolders.MANIFEST).write_text(json.dumps({"format": stepfolders.FORMAT, "files": {"a": {}}}))
        with pytest.raises(CheckpointError, match="is damaged") as got:
            verify(tmp_path, _OneRank())
    else:
        if case == "cannot inspect":
            monkeypatch.setattr(_save.Claim, "of", lambda *a: (_ for _ in ()).throw(OSError(13, "denied")))
        group = _OneRank()
        if case == "copies differ":   # rank 1's digest of model.w is another
            group = types.SimpleNamespace(rank=0, world=2, all_gather=lambda obj, what: [
                obj, (*obj[:3], [(("model.w", 0, 4), 8)])])
        ckpt = types.SimpleNamespace(group=group, root=tmp_path, on_nonfinite="error")
        snap = {"step": 2, "bytes": 1 << 62 if case == "no room" else 1, "nonfinite": ["w"] if case == "non-finite"
                else [], "copies": [(("model.w", 0, 4), 7)], "keep_last": 2}   # (as save sets it)
        said = "ranks 0 and 1 hold different values of model.w" if case == "copies differ" else ""
        with pytest.raises(FrameworkError, match=f"not saving step 2: .*{said}") as got:
            _save._agree_to_save(ckpt, snap, None, lambda: None)
    assert got.value.every_rank, got.value


@pytest.mark.parametrize("resume, said", [
    ("PATH", "is damaged"),
    ("auto", r"^checkpoint.resume=auto: every checkpoint in \S+ is damaged or not finite \(the folders are kept; "
             r"use another checkpoint.dir to start this run afresh\)"),
    # resolved by the CLI to another run's folder: said as typed, and resume=off starts afresh there
    ("latest", r"^checkpoint.resume=latest: every checkpoint in \S+other is damaged or not finite \(the folders are "
               r"kept; set checkpoint.resume=off to start this run afresh, or checkpoint.resume to a good checkpoint's "
               r"step-<N> folder\)")])
def test_a_resume_refused_after_agreed_damage_keeps_the_mark(tmp_path, monkeypatch, resume, said):
    """``resume=PATH`` damaged, or ``resume=auto`` or ``latest`` with every checkpoint damaged: the error that ends
    the resume replaces the agreed ones, is marked as raised on every rank as they were, and its way out works."""
    import types
    import framework.persist.checkpoint as checkpoint
    from framework.core.errors import on_every_rank

    where = tmp_path / "other" if resume == "latest" else tmp_path
    folders = [where / "step-2"] if resume == "PATH" else [where / "step-2", where / "step-1"]
    for folder in folders:   # (there: a folder gone since it was listed is a live run's rotation, no damage)
        folder.mkdir(parents=True)
    monkeypatch.setattr(checkpoint, "choose", lambda *a, **k: (folders, []))
    monkeypatch.setattr(checkpoint, "load", lambda *a, **k: (_ for _ in ()).throw(
        on_every_rank(CheckpointError("checkpoint step-2 is damaged"))))
    ckpt = object.__new__(checkpoint.Checkpointer)
    given = {"PATH": str(folders[0]), "auto": "auto", "latest": str(where)}[resume]
    ckpt.cfg, ckpt.closed, ckpt.resume_given = types.SimpleNamespace(resume=given, every=1), False, \
        "latest" if resume == "latest" else given
    ckpt.group, ckpt.rank, ckpt.root, ckpt.engine, ckpt.seed, ckpt.config = _OneRank(), 0, tmp_path, None, 0, {}
    ckpt.data, ckpt._pending = None, None   # (no save in flight: resume waits for one first)
    with pytest.raises(CheckpointError, match=said) as got:
        ckpt.resume(types.SimpleNamespace(step=0))   # (a fresh state: its step is read for the notes)
    assert got.value.every_rank, got.value


@pytest.mark.parametrize("stop", [KeyboardInterrupt, lambda: SystemExit(143)])
def test_an_interrupt_while_dcp_writes_or_reads_a_checkpoint_is_raised_as_such(tmp_path, stop):
    """Ctrl-C (or SIGTERM's SystemExit) inside DCP's writer: the save's unfinished folder is removed and the
    interrupt is raised, not a CheckpointError ("saving step-2 failed": exit 1, a sweep going on); inside its
    reader: the interrupt, not a CheckpointError (resume=auto would fall back to an older checkpoint)."""
    import torch.distributed.checkpoint as dcp
    from framework.persist.checkpoint._group import agree_load, agree_save, glue

    class Writer(dcp.FileSystemWriter):
        def write_data(self, plan, planner):
            raise stop()

    class Reader(dcp.FileSystemReader):
        def read_data(self, plan, planner):
            raise stop()

    kind = type(stop())
    tmp = tmp_path / "step-2.tmp"
    tmp.mkdir()
    glue().quiet_no_dist()   # (what a one-rank save or load sets)
    with pytest.raises(BaseException) as got:
        agree_save(_OneRank(), "writing the files",
                   lambda: dcp.save({"w": torch.ones(4)}, storage_writer=Writer(tmp), no_dist=True), tmp)
    assert type(got.value) is kind and getattr(got.value, "code", None) == getattr(stop(), "code", None), got.value
    assert not tmp.exists()
    dcp.save({"w": torch.ones(4)}, storage_writer=dcp.FileSystemWriter(tmp_path / "step-1"), no_dist=True)
    with pytest.raises(BaseException) as got:
        agree_load(_OneRank(), "reading", lambda: dcp.load({"w": torch.zeros(4)}, no_dist=True,
                                                           storage_reader=Reader(tmp_path / "step-1")))
    assert type(got.value) is kind and getattr(got.value, "code", None) == getattr(stop(), "code", None), got.value


def test_a_save_failing_while_an_interrupt_is_handled_is_a_save_failure(tmp_path):
    """A save made in ``except KeyboardInterrupt:`` (save on Ctrl-C) that fails for its own reason (a full disk)
    reports that reason: the interrupt being handled is every such error's ``__context__``, not its cause."""
    import torch.distributed.checkpoint as dcp
    from framework.persist.checkpoint._group import agree_save, glue

    class Full(dcp.FileSystemWriter):
        def write_data(self, plan, planner):
            raise OSError(28, "No space left on device")

    tmp = tmp_path / "step-2.tmp"
    tmp.mkdir()
    glue().quiet_no_dist()   # (what a one-rank save or load sets)
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt:
        with pytest.raises(CheckpointError, match="is full"):
            agree_save(_OneRank(), "writing the files",
                       lambda: dcp.save({"w": torch.ones(4)}, storage_writer=Full(tmp), no_dist=True), tmp)


@pytest.mark.parametrize("keep_last", [0, 1, 3])
def test_a_full_disk_suggests_a_lower_keep_last_only_where_one_keeps_fewer(tmp_path, keep_last):
    """keep_last=1 keeps the fewest already (0 keeps all): a full disk's line does not offer lowering it then."""
    import torch.distributed.checkpoint as dcp
    from framework.persist.checkpoint._group import agree_save, glue

    class Full(dcp.FileSystemWriter):
        def write_data(self, plan, planner):
            raise OSError(28, "No space left on device")

    (tmp := tmp_path / "step-2.tmp").mkdir()
    glue().quiet_no_dist()
    with pytest.raises(CheckpointError, match="is full") as got:
        agree_save(_OneRank(), "writing the files", lambda: dcp.save({"w": torch.ones(4)}, storage_writer=Full(tmp),
                                                                     no_dist=True), tmp, need=1 << 20,
                   keep_last=keep_last)
    fixes = str(got.value).rsplit("): ", 1)[1]
    assert fixes == {0: "free space, set checkpoint.keep_last=N to keep only the N newest checkpoints or set "
                        "checkpoint.dir to a larger disk; the previous checkpoints are kept",
                     1: "free space or set checkpoint.dir to a larger disk; the previous checkpoints are kept",
                     3: "free space, lower checkpoint.keep_last or set checkpoint.dir to a larger disk; the previous "
                        "checkpoints are kept"}[keep_last], got.value


def test_a_file_size_limit_during_a_save_is_not_called_a_full_disk(tmp_path):
    """EFBIG (``ulimit -f``) while DCP writes: torch's zip writer reports it as "unexpected pos", as it does a
    full disk, with the EFBIG underneath; the line names the limit, not free space the disk has."""
    import torch.distributed.checkpoint as dcp
    from framework.persist.checkpoint._group import agree_save, glue
    from tests._helpers import file_size_limit

    tmp = tmp_path / "step-2.tmp"
    tmp.mkdir()
    glue().quiet_no_dist()   # (what a one-rank save or load sets)
    with pytest.raises(CheckpointError) as got, file_size_limit(64 << 10):
        agree_save(_OneRank(), "writing the files", lambda: dcp.save(
            {"w": torch.ones(1 << 16), "b": [torch.ones(2)]}, storage_writer=dcp.FileSystemWriter(tmp), no_dist=True),
            tmp, need=600 << 10, largest=300 << 10)
    # the limit named, and the largest single file it must admit (one rank's), not the whole checkpoint
    assert str(got.value) == (f"checkpoint: saving step-2 failed (writing the files): rank 0: this process's file "
                              f"size limit (RLIMIT_FSIZE: 0.06 MiB (65536 bytes)) stopped the writes in {tmp_path} (its"
                              f" largest file needs about 0.29 MiB (307200 bytes)): raise the file size limit above "
                              f"that (bash: ulimit -f 300 or more, in 1024-byte blocks) or set checkpoint.dir to a "
                              f"file system that takes larger files; the previous checkpoints are kept"), got.value
    assert not tmp.exists()


def test_a_file_size_limit_above_the_largest_file_is_not_blamed_for_efbig(tmp_path):
    """EFBIG with a ulimit -f far above the largest file (a FAT-like file system's 4 GiB maximum stopped it): the
    file system's limit is named, not the ulimit; a limit under one 1024-byte block is not called ``ulimit -f 0``."""
    import errno
    from framework.persist.checkpoint._group import _write_error
    from tests._helpers import file_size_limit

    efbig = OSError(errno.EFBIG, "File too large")
    with file_size_limit(100 << 30):
        said = _write_error(efbig, tmp_path / "step-2.tmp", need=12 << 30, largest=6 << 30)
    assert said == (f"the file system's largest file size stopped the writes in {tmp_path} (its largest file needs "
                    f"about 6.00 GiB (6442450944 bytes)): set checkpoint.dir to a file system that takes larger "
                    f"files"), said
    with file_size_limit(1000):
        said = _write_error(efbig, tmp_path / "step-2.tmp", need=3000)
    assert said.startswith("this process's file size limit (RLIMIT_FSIZE: 0.00 MiB (1000 bytes)) stopped") and (
        "(bash: ulimit -f 3 or more, in 1024-byte blocks)" in said), said


def test_too_many_open_files_in_a_save_or_a_run_is_one_line_with_the_limit(tmp_path):
    """EMFILE (``ulimit -n`` set low): one line naming the limit and the fix, in a save (which keeps the previous
    checkpoints) and anywhere else in a run, not a traceback of an OSError."""
    import resource

    from framework.core.room import descriptors_named
    from framework.persist.checkpoint._group import agree_save, glue

    def emfile():
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE), str(tmp_path / "x"))
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    says = rf"too many open files \(opening {tmp_path}/x\): this process may have {soft} open \(ulimit -n\);"
    (tmp := tmp_path / "step-2.tmp").mkdir()
    glue().quiet_no_dist()
    with pytest.raises(CheckpointError, match=rf"failed \(writing the files\): rank 0: {says}.*ulimit -n \d+"):
        agree_save(_OneRank(), "writing the files", emfile, tmp)
    with pytest.raises(FrameworkError, match=f"^{says}") as got, descriptors_named():
        emfile()
    assert got.value.__cause__ is None and got.value.__suppress_context__
    with pytest.raises(OSError, match="No such file"), descriptors_named():   # any other OSError: as it was
        open(tmp_path / "missing")
    # gloo's sockets out of descriptors (a RuntimeError naming no file): that line, not a peer blamed or waited for
    from framework.comm.distributed import Dist

    def gloo(text):
        raise RuntimeError(f"[enforce fail at ../gloo/transport/tcp/socket.cc:24] {text}")
    dist = Dist(rank=1, world=2, local_rank=1, device=torch.device("cpu"), backend="gloo", timeout_s=300.0)
    with pytest.raises(DistributedError, match=rf"^rank 1/2: group creation: too many open files: this process may "
                                               rf"have {soft} open \(ulimit -n\);") as got:
        dist._run("group creation", gloo, "socket: Too many open files")
    assert not got.value.waited
    with pytest.raises(DistributedError, match=r"^rank 1/2: group creation: too many open files on this host: .*"
                                               r"fs.file-max"):
        dist._run("group creation", gloo, "epoll_create: Too many open files in system")


def test_a_malformed_manifest_entry_is_refused_on_every_rank(tmp_path):
    """An edited manifest whose file entry is not {bytes, sha256} is one CheckpointError naming the
    manifest (it used to be a KeyError on the rank that read it, its peers left waiting)."""
    from framework.persist import stepfolders
    from framework.persist.checkpoint._load import verify

    (tmp_path / "a").write_text("x")
    (tmp_path / stepfolders.MANIFEST).write_text(json.dumps({"format": stepfolders.FORMAT, "files": {"a": {"size": 1}}}))
    with pytest.raises(_Sent) as got:
        verify(tmp_path, _Gather(0, 1))
    with pytest.raises(CheckpointError, match=r"manifest.json has a malformed file entry \(KeyError"):
        verify(tmp_path, _Gather(0, 1, [got.value.args[0]]))
    # a file name the OS refuses (an embedded NUL byte): the same, not a ValueError on one rank
    (tmp_path / stepfolders.MANIFEST).write_text(json.dumps({"format": stepfolders.FORMAT, "files": {"a\u0000b": {}}}))
    with pytest.raises(_Sent) as got:
        verify(tmp_path, _Gather(0, 1))
    with pytest.raises(CheckpointError, match=r"manifest.json has a malformed file entry \(ValueError"):
        verify(tmp_path, _Gather(0, 1, [got.value.args[0]]))


def test_a_manifest_naming_a_file_outside_its_folder_is_refused_on_every_rank(tmp_path):
    """A manifest entry is a file name in the checkpoint folder: an edited one naming a path (``../x``,
    ``sub/x``) is refused like other manifest damage, even when that file's size and checksum match,
    with the same CheckpointError on every rank (only rank 0 checks it here)."""
    from framework.persist import stepfolders
    from framework.persist.checkpoint._load import verify

    folder = tmp_path / "step-1"
    (folder / "sub").mkdir(parents=True)
    for where in (tmp_path / "x", folder / "sub" / "x", folder / "z"):
        where.write_text("x")
    for name in ("../x", "sub/x"):
        entries = {name: stepfolders.file_entry(folder, name), "z": stepfolders.file_entry(folder, "z")}
        (folder / stepfolders.MANIFEST).write_text(json.dumps({"format": stepfolders.FORMAT, "files": entries}))
        sent = []
        for rank in (0, 1):
            with pytest.raises(_Sent) as got:
                verify(folder, _Gather(rank, 2))
            sent.append(got.value.args[0])
        assert sent[1] == []   # rank 1's share ("z") is sound
        for rank in (0, 1):
            with pytest.raises(CheckpointError, match=f"is damaged: .*manifest.json names {name!r}, which is "
                                                      f"not a file name in the folder"):
                verify(folder, _Gather(rank, 2, sent))


def test_the_manifest_covers_the_16bit_weights_subfolder(tmp_path):
    """The zero3 16-bit weights a save puts in ``model_16bit/`` are in the manifest as
    ``model_16bit/<name>`` and checked like the other files: a flipped byte there is damage; a link
    there (the subfolder itself, or a file in it) is refused, never read through. A manifest without
    those entries (an older checkpoint's) still verifies."""
    from framework.persist import stepfolders
    from framework.persist.checkpoint._load import verify

    folder = tmp_path / "step-1"
    (folder / "model_16bit").mkdir(parents=True)
    (folder / "a.distcp").write_bytes(b"shard")
    (folder / "model_16bit" / "model.safetensors").write_bytes(b"weights")
    (folder / "model_16bit" / "config.json").write_text("{}")
    names = stepfolders.files_of(folder)
    assert names == ["a.distcp", "model_16bit/config.json", "model_16bit/model.safetensors"]
    entries = {n: stepfolders.file_entry(folder, n) for n in names}
    assert (folder / "model_16bit" / "model.safetensors").stat().st_mode & 0o777 == 0o600
    stepfolders.write_manifest(folder, entries)
    verify(folder)
    weights = folder / "model_16bit" / "model.safetensors"
    weights.write_bytes(b"weightz")
    with pytest.raises(CheckpointError, match=f"is damaged: {weights} does not match its sha256"):
        verify(folder)
    verify(folder, resume=True)   # a resume does not read the copy (the line it prints: tests/dist/test_weights.py)
    (folder / "a.distcp").write_bytes(b"shart")   # ... but it reads the DCP files
    with pytest.raises(CheckpointError, match=f"is damaged: {folder / 'a.distcp'} does not match its sha256 "
                                              r"checksum in the manifest \(altered or corrupted\)$"):
        verify(folder, resume=True)
    (folder / "a.distcp").write_bytes(b"shard")
    # an older checkpoint's manifest: the top-level files only
    (folder / stepfolders.MANIFEST).unlink()
    stepfolders.write_manifest(folder, {"a.distcp": entries["a.distcp"]})
    verify(folder)
    # one that lists the subfolder lists all of it: a file left out is damage, as at the top level
    (folder / stepfolders.MANIFEST).unlink()
    stepfolders.write_manifest(folder, {n: e for n, e in entries.items() if n != "model_16bit/config.json"})
    with pytest.raises(CheckpointError, match=f"is damaged: {folder / 'model_16bit/config.json'} is not in manifest"):
        verify(folder)
    # a link in the subfolder, and the subfolder as a link: refused by name, by a save and by verify
    (folder / stepfolders.MANIFEST).unlink()
    stepfolders.write_manifest(folder, entries)
    weights.unlink()
    link, victim = _plant(tmp_path, "step-1/model_16bit/model.safetensors")
    victim.write_bytes(b"weights")
    with pytest.raises(UnsafePathError, match=f"^{link} is a symbolic link"):
        stepfolders.files_of(folder)
    with pytest.raises(CheckpointError, match=f"is damaged: {link} is a symbolic link"):
        verify(folder)
    moved = tmp_path / "elsewhere"
    (folder / "model_16bit").rename(moved)
    (moved / "model.safetensors").unlink()
    (moved / "model.safetensors").write_bytes(b"weights")
    (folder / "model_16bit").symlink_to(moved)
    with pytest.raises(UnsafePathError, match=f"^{folder / 'model_16bit'} is a symbolic link"):
        stepfolders.files_of(folder)
    with pytest.raises(CheckpointError, match=f"is damaged: {folder / 'model_16bit'} is a symbolic link"):
        verify(folder)
    with pytest.raises(UnsafePathError, match="is a symbolic link"):
        stepfolders.file_entry(folder, "model_16bit/model.safetensors")


def test_positional_io_refuses_a_strided_or_device_tensor(tmp_path):
    """``write_at``/``read_into`` move a host tensor's own bytes: a strided one would be copied by the
    reshape (a read would land in the copy and be lost), a device one has no host bytes."""
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        write_at(fd, torch.arange(16, dtype=torch.float32), 0)
        out = torch.zeros(4, 4)
        assert read_into(fd, out, 0) is None and out.flatten().tolist() == list(range(16))
        for bad, kind in ((torch.zeros(4, 4).t(), "cpu strided"), (torch.zeros(4, device="meta"), "meta contiguous")):
            for call in (write_at, read_into):
                with pytest.raises(ValueError, match=f"needs a contiguous host tensor, got {kind}"):
                    call(fd, bad, 0)
    finally:
        os.close(fd)


@pytest.mark.parametrize("error", [AssertionError(), OSError(), RuntimeError("\n")])
def test_a_rank_failing_without_a_message_is_still_heard_by_its_peers(error):
    """``agree`` sends each rank's failure to its peers before raising it: one without a message (a bare
    ``assert``, ``raise OSError()``) raised IndexError before the exchange, and its peers waited the timeout."""
    from framework.comm.distributed import agree

    class Sent(Exception):
        pass

    class Dist:
        rank = 1

        def all_gather_object(self, obj, what):
            raise Sent(obj)

    def fail():
        raise error

    with pytest.raises(Sent) as got:
        agree(Dist(), fail, "saving")
    assert got.value.args[0] == (f"rank 1: {type(error).__name__}", False)


def test_a_manifest_that_cannot_be_read_is_not_called_missing(tmp_path, monkeypatch):
    """Only a manifest that does not exist is "no manifest.json (deleted, or an interrupted save)"; one that
    cannot be read (a folder without search permission) is named unreadable, with the system's reason."""
    from framework.core import files
    from framework.persist import stepfolders

    stepfolders.write_manifest(tmp_path, {})

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(tmp_path / stepfolders.MANIFEST))

    monkeypatch.setattr(os, "lstat", denied)
    monkeypatch.setattr(files, "open_nofollow", denied)
    with pytest.raises(CheckpointError, match="unreadable as the manifest .*Permission denied"):
        stepfolders.read_manifest(tmp_path)


def test_a_manifest_nested_too_deeply_to_parse_is_unreadable_not_a_traceback(tmp_path):
    from framework.core import files
    from framework.persist import stepfolders

    files.write_new(tmp_path / stepfolders.MANIFEST, ('[' * 100_000 + ']' * 100_000).encode())
    with pytest.raises(CheckpointError, match=r"manifest.json is unreadable as the manifest \(nested too deeply"):
        stepfolders.read_manifest(tmp_path)


def test_a_lost_checkpoint_lock_says_whether_the_checkpoints_went_with_it(tmp_path, capsys):
    """The re-lock's warning: the ``.lock`` alone removed (a clean-up script) keeps the step folders, so it does not
    call them gone; the folder removed (``rm -rf``) does."""
    import shutil

    from framework.core import files
    from framework.persist import stepfolders
    from framework.persist.checkpoint._lock import HeldLock, identity

    root = tmp_path / "ck"
    (root / "step-2").mkdir(parents=True)
    fd = files.lock(root / stepfolders.LOCK, lambda holder: "busy", None)
    held = HeldLock(root, identity(fd))
    try:
        os.unlink(root / stepfolders.LOCK)
        held.check()
        said = capsys.readouterr().err
        assert said == (f"warning: checkpoint: checkpoint.dir {root} lost this run's .lock (removed during the run?): "
                        f"locked it again, so that no other run saves there; its checkpoints are still there\n"), said
        shutil.rmtree(root)
        held.check()
        said = capsys.readouterr().err
        assert said.endswith("(the folder removed during the run?): locked it again, so that no other run saves "
                             "there; checkpoints removed with it are gone\n"), said
    finally:
        held.close()
        os.close(fd)


def test_a_step_del_that_cannot_be_deleted_names_the_file_by_its_full_path(tmp_path, monkeypatch):
    """rmtree deletes by a descriptor of the folder, so its error's filename is the bare name: the warning names the
    file under the checkpoint folder instead (``(Permission denied: f)`` said nothing of where)."""
    from framework.persist import stepfolders

    (tmp_path / "step-3.del" / "sub").mkdir(parents=True)
    (tmp_path / "step-3.del" / "sub" / "f").write_text("x")
    unlink = os.unlink

    def refused(path, *a, **kw):
        if os.path.basename(path) == "f":
            raise PermissionError(errno.EPERM, "Operation not permitted", path)
        return unlink(path, *a, **kw)
    monkeypatch.setattr(os, "unlink", refused)
    stuck = stepfolders.remove_stale(tmp_path)
    assert stuck == [f"{tmp_path / 'step-3.del'} (Operation not permitted: {tmp_path / 'step-3.del' / 'sub' / 'f'})"]
