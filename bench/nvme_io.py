"""The NVMe offload's IO engine against the raw disk: read and write GB/s for 1 GiB of tensors.

    .venv/bin/python -m bench.nvme_io                        # folder: ./.bench-nvme (same FS as the repo)
    .venv/bin/python -m bench.nvme_io --dir /mnt/nvme0/tmp --rounds 3
    .venv/bin/python -m bench.nvme_io --size 64MiB --block-sizes 1MiB --queue-depths 4 --no-fio   # quick

Ours: ``framework.offload.AsyncIO`` moving ``--size`` bytes as fp32 tensors of ``--tensor-size``
(page-aligned buffers from ``aligned_empty``, O_DIRECT, one swap file) at every ``--block-sizes`` x
``--queue-depths`` pair (intra_op_parallelism 1: ``queue_depth`` pieces in flight), all requests
submitted at once and then waited for, with the default checksum (sum64) and, at the best pair,
also with none and with crc32:
the differences are the checksums' costs. The first read of each round is compared bitwise with what
was written.

Raw: ``fio`` (``--direct=1 --ioengine=libaio``, sequential, 1 job, the same block size and queue
depth, run right after ours at each setting) on a file of the same size in the same folder, and
``dd`` with ``oflag=direct`` / ``iflag=direct`` at 4 MiB blocks, once a round; both left out when
``--no-fio`` (fio also where it is not installed). fio moves its data through ``iodepth`` buffers
it reuses, which stay in the CPU caches; ours moves 1 GiB of distinct memory, as offload does.
"bare-threads" rows (at ours' best setting) issue the same O_DIRECT system calls from a plain
thread pool, no engine: into the same tensors (huge pages), into the same bytes in 4 KiB pages,
and into ``depth`` reused one-block buffers (fio's pattern), which shows what the memory costs. The machine
is shared (two cores, one disk), so each figure is the best of the rounds (what the disk can do)
with the median beside it. Prints a Markdown table for BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from bench._common import machine
from framework.comm.accelerator import for_device
from framework.offload import AsyncIO, SwapFile, aligned_empty

UNITS = {"": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30}


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 1GiB, 256KiB, 4M)")
    return int(float(m.group(1)) * UNITS[m.group(2).lower()])


def human(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


def ours(swap: SwapFile, tensors: list[torch.Tensor], names: list[str], block: int, depth: int,
         checksum: str, verify: list[torch.Tensor] | None) -> dict:
    """One write of every tensor, then one read back; GB/s of each and CPU seconds per GB."""
    out = {}
    with AsyncIO(block, depth, 1, direct=True, checksum=checksum) as io:
        for op in ("write", "read"):
            if op == "read" and verify is not None:
                for x in tensors[:len(verify)]:
                    x.zero_()   # so the comparison below sees what the read brought back
            cpu, t = time.process_time(), time.perf_counter()
            call = io.pwrite if op == "write" else io.pread
            handles = [call(swap, swap.extent(n)[0], x, n) for n, x in zip(names, tensors)]
            for h in handles:
                h.wait()
            wall = time.perf_counter() - t
            nbytes = sum(x.numel() * x.element_size() for x in tensors)
            out[op] = nbytes / wall / 1e9
            out[op + "_cpu_s_per_gb"] = (time.process_time() - cpu) / (nbytes / 1e9)
        if verify is not None:
            for x, v in zip(tensors, verify):
                if not torch.equal(x.view(torch.int32), v.view(torch.int32)):
                    raise SystemExit("bench.nvme_io: read back differs from what was written")
    return out


def bare(swap: SwapFile, tensors: list[torch.Tensor], names: list[str], block: int, depth: int,
         memory: str = "tensors") -> dict:
    """The system calls alone: ``depth`` threads each issuing one O_DIRECT preadv / pwritev per block
    (no pieces bookkeeping, checksums or error reports): the ceiling of any thread-pool engine.
    ``memory``: "tensors" (straight into ours: huge pages where the kernel granted them), "4k" (the
    same bytes in an mmap advised MADV_NOHUGEPAGE) or "reused" (``depth`` buffers of one block
    each, cycled, as fio does)."""
    fd = os.open(swap.path, os.O_RDWR | os.O_DIRECT)
    jobs = [(swap.extent(n)[0] + o, x.data_ptr() + o, min(block, x.numel() * 4 - o))
            for n, x in zip(names, tensors) for o in range(0, x.numel() * 4, block)]
    keep = None
    if memory == "4k":
        total = sum(x.numel() * 4 for x in tensors)
        keep = mmap.mmap(-1, total)
        keep.madvise(mmap.MADV_NOHUGEPAGE)
        keep.write(bytes(total))   # committed before timing, like the tensors
        base = ctypes.addressof((ctypes.c_char * total).from_buffer(keep))
        jobs = [(off, base + i * block, n) for i, (off, _, n) in enumerate(jobs)]
    elif memory == "reused":
        keep = mmap.mmap(-1, depth * block)
        base = ctypes.addressof((ctypes.c_char * (depth * block)).from_buffer(keep))
        jobs = [(off, base + (i % depth) * block, n) for i, (off, _, n) in enumerate(jobs)]
    out = {}
    try:
        with ThreadPoolExecutor(depth) as pool:
            for op in ("write", "read"):
                call = os.pwritev if op == "write" else os.preadv

                def one(job):
                    off, address, n = job
                    assert call(fd, [(ctypes.c_char * n).from_address(address)], off) == n

                cpu, t = time.process_time(), time.perf_counter()
                list(pool.map(one, jobs))
                wall = time.perf_counter() - t
                nbytes = sum(j[2] for j in jobs)
                out[op] = nbytes / wall / 1e9
                out[op + "_cpu_s_per_gb"] = (time.process_time() - cpu) / (nbytes / 1e9)
    finally:
        os.close(fd)
    return out


def fio(path: str, size: int, block: int, depth: int) -> dict:
    out = {}
    for op in ("write", "read"):
        cmd = ["fio", "--name=raw", f"--filename={path}", f"--size={size}", f"--bs={block}", f"--rw={op}",
               "--direct=1", "--ioengine=libaio", f"--iodepth={depth}", "--numjobs=1",
               "--output-format=json", "--end_fsync=0", "--invalidate=1"]
        res = subprocess.run(cmd, capture_output=True, text=True, check=True)
        job = json.loads(res.stdout[res.stdout.index("{"):])["jobs"][0]
        out[op] = job[op]["bw_bytes"] / 1e9
        cpu_s = (job["usr_cpu"] + job["sys_cpu"]) / 100 * job["job_runtime"] / 1e3
        out[op + "_cpu_s_per_gb"] = cpu_s / (job[op]["io_bytes"] / 1e9)
    return out


def dd(path: str, size: int, block: int = 4 << 20) -> dict:
    out = {}
    count = size // block
    for op, args in (("write", ["if=/dev/zero", f"of={path}", "oflag=direct", "conv=notrunc"]),
                     ("read", [f"if={path}", "of=/dev/null", "iflag=direct"])):
        t = time.perf_counter()
        subprocess.run(["dd", *args, f"bs={block}", f"count={count}", "status=none"], check=True)
        out[op] = count * block / (time.perf_counter() - t) / 1e9
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=".bench-nvme", help="folder on the disk to measure (created, then removed)")
    p.add_argument("--size", type=parse_size, default=1 << 30)
    p.add_argument("--tensor-size", type=parse_size, default=64 << 20)
    p.add_argument("--block-sizes", default="256KiB,1MiB,4MiB")
    p.add_argument("--queue-depths", default="1,4,8,16,32")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--no-fio", action="store_true", help="skip the raw tools (fio, dd)")
    args = p.parse_args(argv)
    blocks = [parse_size(b) for b in args.block_sizes.split(",")]
    depths = [int(d) for d in args.queue_depths.split(",")]

    os.makedirs(args.dir, exist_ok=True)
    folder = tempfile.mkdtemp(prefix="nvme-io-", dir=args.dir)
    acc = for_device(torch.device("cpu"), "plain")
    numel = args.tensor_size // 4
    count = max(1, args.size // args.tensor_size)
    names = [f"t{i}" for i in range(count)]
    rows: dict[tuple, list[dict]] = {}
    try:
        with SwapFile.create(os.path.join(folder, "rank00000.bench.swap"), {n: numel * 4 for n in names},
                             layout_hash="bench", world_size=1, rank=0, dtype=torch.float32) as swap:
            g = torch.Generator().manual_seed(0)
            tensors = [aligned_empty(numel, torch.float32, pin=True, acc=acc) for _ in names]
            for x in tensors:
                x.copy_(torch.randn(numel, generator=g))
            expect = [x.clone() for x in tensors[:2]]
            raw_path = os.path.join(folder, "raw.fio")
            use_fio = not args.no_fio and shutil.which("fio")
            for r in range(args.rounds):
                for block in blocks:
                    for depth in depths:   # ours and fio alternate at each setting
                        check = r == 0 and block == blocks[0] and depth == depths[0]
                        res = ours(swap, tensors, names, block, depth, "sum64", expect if check else None)
                        rows.setdefault(("ours", block, depth, "sum64"), []).append(res)
                        if use_fio:
                            rows.setdefault(("fio", block, depth, ""), []).append(
                                fio(raw_path, count * numel * 4, block, depth))
                if not args.no_fio:
                    rows.setdefault(("dd", 4 << 20, 1, ""), []).append(dd(raw_path, count * numel * 4))
            best_ours = max((k for k in rows if k[0] == "ours"),
                            key=lambda k: max(x["write"] for x in rows[k]) + max(x["read"] for x in rows[k]))
            for r in range(args.rounds):   # the checksums' cost and the bare system calls, at the best pair
                for kind in ("none", "sum64", "crc32"):
                    res = ours(swap, tensors, names, best_ours[1], best_ours[2], kind, None)
                    rows.setdefault(("ours-checksum", best_ours[1], best_ours[2], kind), []).append(res)
                for memory in ("tensors", "4k", "reused"):
                    rows.setdefault((f"bare-threads, {memory}", best_ours[1], best_ours[2], "none"), []).append(
                        bare(swap, tensors, names, best_ours[1], best_ours[2], memory))
    finally:
        shutil.rmtree(folder, ignore_errors=True)

    table = []
    for (system, block, depth, crc), runs in rows.items():
        row = {"system": system, "block": block, "depth": depth, "checksum": crc}
        for op in ("write", "read"):
            row[op] = max(x[op] for x in runs)
            row[op + "_median"] = statistics.median(x[op] for x in runs)
            cpu = [x.get(op + "_cpu_s_per_gb") for x in runs if op + "_cpu_s_per_gb" in x]
            row[op + "_cpu_s_per_gb"] = statistics.median(cpu) if cpu else None
        table.append(row)
    report(table, args, count * numel * 4)
    return table


def report(table: list[dict], args, nbytes: int) -> None:
    print(f"\n{machine()}; folder {os.path.abspath(args.dir)} "
          f"({subprocess.run(['df', '--output=fstype', args.dir], capture_output=True, text=True).stdout.split()[-1]}); "
          f"{human(nbytes)} as {human(args.tensor_size)} fp32 tensors; best of {args.rounds} rounds (median)\n")
    print("| system | block | queue depth | checksum | write GB/s | read GB/s | CPU s/GB write / read |")
    print("|---|---|---|---|---|---|---|")
    for r in table:
        cpu = (f"{r['write_cpu_s_per_gb']:.2f} / {r['read_cpu_s_per_gb']:.2f}"
               if r["write_cpu_s_per_gb"] is not None else "")
        print(f"| {r['system']} | {human(r['block'])} | {r['depth']} | {r['checksum']} | "
              f"{r['write']:.2f} ({r['write_median']:.2f}) | {r['read']:.2f} ({r['read_median']:.2f}) | {cpu} |")
    raw = [r for r in table if r["system"] in ("fio", "dd")]
    mine = [r for r in table if r["system"] == "ours"]
    if raw and mine:
        if not any(r["system"] == "fio" for r in raw):   # dd ran, so fio was asked for but is not here
            print("\nnote: fio not installed: raw = dd only (4 MiB blocks, depth 1)")
        for op in ("write", "read"):
            best_raw = max(r[op] for r in raw)
            best = max(r[op] for r in mine)
            print(f"\n{op}: ours {best:.2f} GB/s = {100 * best / best_raw:.0f}% of the best raw {best_raw:.2f} GB/s")
    pair = {r["checksum"]: r for r in table if r["system"] == "ours-checksum"}
    for kind in ("sum64", "crc32"):
        if kind in pair and "none" in pair:
            for op in ("write", "read"):
                on, off = pair[kind], pair["none"]
                print(f"{kind} cost ({op}): {off[op]:.2f} -> {on[op]:.2f} GB/s, CPU "
                      f"{off[op + '_cpu_s_per_gb']:.2f} -> {on[op + '_cpu_s_per_gb']:.2f} s/GB")


if __name__ == "__main__":
    main()
