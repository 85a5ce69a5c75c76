"""A real large-model round from a file on disk: K client updates of d parameters in
one raw bfloat16 file, aggregated by FedAvg, Kuramoto-FedAvg and FedAWARE, each in a fresh process: the
aggregators themselves over a ``fedkernels.sources.RawFileSource`` read in column chunks (through
``fedkernels.streaming``'s ``streamed_*``: the result pass writes into a mapped temporary file that is
published (fsync, rename) after success; FedAWARE's table is ``momentum_file=`` in ``--dir``, in
``--dtype``).

Reported per method: wall time, bytes read (passes x file size, + FedAWARE's momentum table read
twice and its participants' rows written once), achieved GB/s, peak RSS (``resource.getrusage``,
which includes the in-memory fp32 global model and the new model, 4 d bytes each), the process's user /
system CPU seconds and page faults, its most expensive calls (cProfile, own time), the load average
before and after (the machine may be shared), and side by side the disk-read floor: ``dd`` of the same
file to /dev/null (one read), so ``floor_s = passes x dd time``; for FedAWARE also ``floor_with_table_s``
(+ two table reads at the dd rate and one table write at the rate the update file was written). The
update file's pages are dropped from the page cache (``POSIX_FADV_DONTNEED``) before ``dd``, before the
read-path measurement and before each method, so every one starts from the disk. ``read_path``: the
source's ``chunks()`` alone over the cold file (no arithmetic), against the same ``dd``.

The update file (and FedAWARE's momentum table, and the output model) live in ``--dir`` (default
/tmp) and are deleted at the end, also on error. Free disk is checked first: the run is refused, with
the sizes, when the files do not fit with ``--margin-gb`` to spare. The result file is rewritten after
each method (``"complete": false`` until the last one), so a run stopped half-way keeps its rows.

    python -m bench.large_model --d 100000000          # a first timing (3.2 GB at K=16)
    python -m bench.large_model --d 1000000000 --out bench/results --append   # the published run
    python -m bench.large_model --d 1e9 --dtype int8+bf16    # FedAvg on bf16 rows, then on int8 rows, one run

``--dtype int8+bf16``: the bf16 FedAvg row (its file, floors, round; the file deleted), then the int8 row (its
file, floors, round), one after the other in one run record (``pair``), with ``int8_vs_bf16`` (bf16 time / int8
time) and each row against the fio floor of its own file measured minutes before it. The disk holds one file at
a time (32 GB at d = 1e9, K = 16).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import shutil
import subprocess
import sys
import time

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import add_out_argument, output_path  # noqa: E402
from fedkernels.sources.chunked import CPU_CHUNK_BYTES  # noqa: E402
from fedkernels.sources.files import READ_BYTES  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
METHODS = ("fedavg", "kuramoto", "fedaware")
# --dtype int8: the clients' rows compressed by compress.kind=int8_block (int8 codes + one float32 scale per
# INT8_BLOCK columns, in a second file), FedAvg on them: agg.aggregate over sources.BlockCodeFile (the round
# runner's packed-rows form, through compress.aggregate_compressed)
INT8_BLOCK = 256


def write_updates(path: str, K: int, d: int, dtype: torch.dtype, block: int = 1 << 24) -> float:
    """Writes K rows of d elements block by block; returns seconds (fsync included). Each block is one
    of R precomputed blocks (a common direction + its own noise) picked by a hash of (row, block), so
    the rows differ (non-trivial Kuramoto / FedAWARE weights) and writing costs no arithmetic."""
    g = torch.Generator().manual_seed(0)
    R = 8
    common = torch.randn(block, generator=g) * 0.05
    blocks = [(common + torch.randn(block, generator=g) * 0.1).to(dtype).view(torch.uint8).numpy() for _ in range(R)]
    es = torch.empty(0, dtype=dtype).element_size()
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for k in range(K):
            for j, a in enumerate(range(0, d, block)):
                w = min(block, d - a)
                f.write(blocks[((k + 1) * (j + 7) * 2654435761 >> 7) % R][: w * es].data)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def drop_cache(path: str) -> None:
    """Drops the file's clean pages from the page cache (no root needed): the next read comes from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def dd_floor(path: str) -> dict:
    """One sequential read of the (cold) file with dd (the disk-read floor of one pass)."""
    drop_cache(path)
    t0 = time.perf_counter()
    r = subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=16M"], capture_output=True, text=True, check=True)
    t = time.perf_counter() - t0
    m = re.search(r"copied, ([0-9.]+) s", r.stderr)
    return {"dd_s": float(m.group(1)) if m else t, "dd_line": r.stderr.strip().splitlines()[-1]}


def read_path(path: str, K: int, d: int, dtype: torch.dtype, chunk_mb: int) -> dict:
    """The source's read path alone: ``RawFileSource.chunks`` over the cold file (K preadv per block, a
    reader thread one block ahead; O_DIRECT for a file larger than the available memory), no arithmetic;
    seconds, GB/s and the read mode."""
    from fedkernels.sources import RawFileSource

    es = torch.empty(0, dtype=dtype).element_size()
    src = RawFileSource(path, K, d, dtype)
    drop_cache(path)
    t0 = time.perf_counter()
    for _ in src.chunks(chunk_cols(K, es, chunk_mb)):
        pass
    t = time.perf_counter() - t0
    return {"read_s": t, "read_GBps": K * d * es / t / 1e9, "read_mode": src.read_mode}


def chunk_cols(K: int, es: int, chunk_mb: int) -> int:
    return max(1024, (chunk_mb << 20) // (K * es))


def load() -> list:
    return [round(x, 2) for x in os.getloadavg()]


def child(method: str, path: str, K: int, d: int, dtype_name: str, chunk_mb: int, workdir: str, threads: int) -> dict:
    """One streamed round in this (fresh) process; returns its measurements."""
    import cProfile
    import pstats
    from fedkernels import algorithms
    from fedkernels.sources import RawFileSource
    from fedkernels.streaming import ChunkedUpdates, streamed_fedavg, streamed_fedaware, streamed_kuramoto

    torch.set_num_threads(threads)
    dtype = DTYPES[dtype_name]
    es = torch.empty(0, dtype=dtype).element_size()
    cols = chunk_cols(K, es, chunk_mb)
    src = ChunkedUpdates(RawFileSource(path, K, d, dtype), chunk_cols=cols)
    x = torch.zeros(d)  # the fp32 global model, in memory
    out = os.path.join(workdir, "fedkernels_large_out.f32")
    n = list(range(10, 10 + K))
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    load0 = load()
    extra_read = extra_write = 0
    prof = cProfile.Profile()
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    prof.enable()
    if method == "fedavg":
        new = streamed_fedavg(x, src, n, out=out)
        passes, info = 1, {}
    elif method == "kuramoto":
        new, info = streamed_kuramoto(x, src, n, out=out)
        passes, info = 2, {"weights": info["weights"]}
    else:
        mpath = os.path.join(workdir, "fedkernels_large_momenta.bin")  # N = K clients, all participate
        agg = algorithms.build(
            "fedaware", num_clients=K, warmup="startup_full", elud=False, momentum_file=mpath, momentum_dtype=dtype
        )
        new, info = streamed_fedaware(x, src, n, list(range(K)), agg, out=out)
        passes = 2  # a screening pass (elud=False), the momentum pass
        extra_read, extra_write = 2 * K * d * es, K * d * es  # the table: read by both table passes, written once
        info = {
            "lam": info["lam"],
            "table_dtype": dtype_name,
            "note": "round 0: the momentum table starts as a zero file (blocks reserved)",
        }
    prof.disable()
    t = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    ok = bool(torch.isfinite(new[: 1 << 20]).all()) and new.numel() == d
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    read = passes * K * d * es + extra_read
    top = sorted(pstats.Stats(prof).stats.items(), key=lambda kv: -kv[1][2])[:6]  # by own time
    return {
        "method": method,
        "time_s": t,
        "passes_over_U": passes,
        "bytes_read": read,
        "bytes_written_table": extra_write,
        "GBps_read": read / t / 1e9,
        "peak_rss_GB": rss * 1024 / 1e9,
        "rss_before_round_GB": rss0 * 1024 / 1e9,
        "chunk_MB": src.staging_bytes / 2**20,
        "read_block_MB": READ_BYTES / 2**20,
        "chunk_cols": cols,
        "torch_threads": threads,
        "loadavg_before": load0,
        "loadavg_after": load(),
        "user_s": r1.ru_utime - r0.ru_utime,
        "sys_s": r1.ru_stime - r0.ru_stime,
        "minor_faults": r1.ru_minflt - r0.ru_minflt,
        "major_faults": r1.ru_majflt - r0.ru_majflt,
        "top_calls_own_s": [
            [fn if file == "~" else f"{os.path.basename(file)}:{line}({fn})", round(st[2], 2)]
            for (file, line, fn), st in top
        ],
        "read_mode": src.source.read_mode,
        "result_ok": ok,
        "info": info,
    }


def fio_floor(path: str, K: int, size: int) -> dict:
    """The device's parallel direct-read bandwidth over the (cold) file, with ``fio`` (Debian: apt-get install fio):
    ``rows``: the file sources' pattern, K streams (one per client row, as the sources read every row of a
    block) of READ_BYTES / K direct reads each, one at a time per stream (psync); ``deep``: the same K streams with
    libaio, 4 reads in flight each. ``floor_GBps`` is the faster: what no reader of this file can beat here."""
    if shutil.which("fio") is None:
        return {"fio": "not installed (apt-get install -y fio)"}
    out = {}
    per = size // K // 4096 * 4096  # direct reads: offsets in multiples of 4096
    for name, extra in (("rows", ["--ioengine=psync", "--iodepth=1"]), ("deep", ["--ioengine=libaio", "--iodepth=4"])):
        drop_cache(path)
        bs = max(4096, (READ_BYTES // K) // 4096 * 4096)
        cmd = [
            "fio",
            f"--name={name}",
            f"--filename={path}",
            "--rw=read",
            "--direct=1",
            f"--bs={bs}",
            f"--numjobs={K}",
            f"--size={per // bs * bs}",
            f"--offset_increment={per}",
            "--group_reporting",
            "--output-format=json",
            "--readonly",
        ] + extra
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            out[name] = {"error": r.stderr.strip()[-300:]}
            continue
        j = json.loads(r.stdout[r.stdout.index("{") :])["jobs"][0]["read"]
        out[name] = {
            "GBps": j["bw_bytes"] / 1e9,
            "bytes": j["io_bytes"],
            "s": j["runtime"] / 1e3,
            "bs": bs,
            "streams": K,
            "cmd": " ".join(cmd[1:]),
        }
    rates = [v["GBps"] for v in out.values() if isinstance(v, dict) and "GBps" in v]
    if rates:
        out["floor_GBps"] = max(rates)
        out["floor_s_one_pass"] = size / (max(rates) * 1e9)
    return out


def write_int8_updates(path: str, scales_path: str, K: int, d: int, block: int = 1 << 24) -> float:
    """K rows of d int8 codes (R precomputed random blocks picked by a hash of (row, block), as write_updates)
    and their float32 scales (one per INT8_BLOCK columns); returns seconds (fsync included)."""
    g = torch.Generator().manual_seed(0)
    blocks = [
        torch.randint(-127, 128, (block,), generator=g, dtype=torch.int8).view(torch.uint8).numpy() for _ in range(8)
    ]
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for k in range(K):
            for i, a in enumerate(range(0, d, block)):
                f.write(memoryview(blocks[hash((k, i)) % 8][: min(block, d - a)]))
        f.flush()
        os.fsync(f.fileno())
    nb = -(-d // INT8_BLOCK)
    (torch.rand(K, nb, generator=g) * 1e-3).numpy().tofile(scales_path)
    return time.perf_counter() - t0


def child_int8(path: str, scales_path: str, K: int, d: int, threads: int) -> dict:
    """FedAvg over the int8 file in this (fresh) process: sources.BlockCodeFile (column blocks of READ_BYTES,
    O_DIRECT always: the file is read once, cold, as the bf16 file is; the source's default would read a
    file that fits in memory through the page cache, at a cost in system time) summed block by block by ops.dequant_weighted_sum
    into the fp32 model (compress.aggregate_compressed: FedAvg's own round)."""
    from fedkernels import algorithms, compress
    from fedkernels.sources import BlockCodeFile

    torch.set_num_threads(threads)
    src = BlockCodeFile(path, scales_path, K, d, INT8_BLOCK, direct=True)
    x = torch.zeros(d)
    n = list(range(10, 10 + K))
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    load0 = load()
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    res = compress.aggregate_compressed(algorithms.build("fedavg"), x, src, n, list(range(K)), kind="int8_block")
    t = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    new = res.params
    ok = bool(torch.isfinite(new[: 1 << 20]).all()) and new.numel() == d
    read = src.nbytes
    return {
        "method": "fedavg",
        "dtype": "int8",
        "block": INT8_BLOCK,
        "time_s": t,
        "passes_over_U": 1,
        "bytes_read": read,
        "bytes_written_table": 0,
        "GBps_read": read / t / 1e9,
        "peak_rss_GB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9,
        "rss_before_round_GB": rss0 * 1024 / 1e9,
        "read_block_MB": READ_BYTES / 2**20,
        "chunk_cols": src.chunk_cols(),
        "torch_threads": threads,
        "loadavg_before": load0,
        "loadavg_after": load(),
        "user_s": r1.ru_utime - r0.ru_utime,
        "sys_s": r1.ru_stime - r0.ru_stime,
        "minor_faults": r1.ru_minflt - r0.ru_minflt,
        "major_faults": r1.ru_majflt - r0.ru_majflt,
        "read_mode": src.codes.read_mode,
        "result_ok": ok,
        "info": {"codec": "int8_block(block=256)"},
    }


def run_int8(args, save=lambda res: None) -> dict:
    """The int8 row: write the K x d int8 file and its scales, dd and fio floors, FedAvg in a fresh process."""
    K, d = args.K, int(args.d)
    size = K * d
    path = os.path.join(args.dir, f"fedkernels_large_Q_{K}x{d}.int8")
    spath = path + ".scales"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    res = {
        "commit": commit.stdout.strip() or None,
        "K": K,
        "d": d,
        "dtype": "int8",
        "block": INT8_BLOCK,
        "file_GB": size / 1e9,
        "scales_GB": 4 * K * -(-d // INT8_BLOCK) / 1e9,
        "dir": args.dir,
        "uptime_before": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
        "complete": False,
        "methods": [],
        "notes": "floor: fio's parallel direct reads of the same cold file (fio_floor: K streams as the sources "
        "read them, and 4 reads in flight each), dd (one buffered sequential reader) beside it",
    }
    try:
        t_write = write_int8_updates(path, spath, K, d)
        res.update(write_s=t_write, write_GBps=size / t_write / 1e9)
        res.update(dd_floor(path))
        res["dd_GBps"] = size / res["dd_s"] / 1e9
        res["fio"] = fio_floor(path, K, size)
        save(res)
        drop_cache(path)
        code = (
            f"import json; from bench.large_model import child_int8; print(json.dumps(child_int8({path!r}, "
            f"{spath!r}, {K}, {d}, {args.threads})))"
        )
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
        if r.returncode != 0:
            raise SystemExit(f"large_model: the int8 round failed:\n{r.stderr[-2000:]}")
        row = json.loads(r.stdout.strip().splitlines()[-1])
        row["floor_dd_s"] = res["dd_s"]
        if "floor_GBps" in res["fio"]:
            row["floor_s"] = row["bytes_read"] / (res["fio"]["floor_GBps"] * 1e9)
            row["vs_floor"] = row["floor_s"] / row["time_s"]
            row["fio_floor_s"], row["vs_fio_floor"] = row["floor_s"], row["vs_floor"]  # (the bf16 rows' names)
        res["methods"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "info"}), flush=True)
        save(res)
    finally:
        for f in (path, spath):
            if os.path.exists(f):
                os.remove(f)
    res["complete"] = True
    return res


def disk_needed(K: int, d: int, dtype: torch.dtype, methods) -> int:
    """Bytes the run writes to --dir: the update file, the fp32 output, FedAWARE's N = K table."""
    size = K * d * torch.empty(0, dtype=dtype).element_size()
    return size + d * 4 + (size if "fedaware" in methods else 0)


def run(args, save=lambda res: None) -> dict:
    """The run; ``save(result)`` is called after each method with the result so far."""
    dtype = DTYPES[args.dtype]
    es = torch.empty(0, dtype=dtype).element_size()
    K, d = args.K, int(args.d)
    size = K * d * es
    free = shutil.disk_usage(args.dir).free
    path = os.path.join(args.dir, f"fedkernels_large_U_{K}x{d}.{args.dtype}")
    junk = [path] + [
        os.path.join(args.dir, f)
        for f in ("fedkernels_large_out.f32", "fedkernels_large_momenta.bin", "fedkernels_large_momenta.bin.state")
    ]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    uptime = subprocess.run(["uptime"], capture_output=True, text=True)
    res = {
        "commit": commit.stdout.strip() or None,
        "K": K,
        "d": d,
        "dtype": args.dtype,
        "file_GB": size / 1e9,
        "dir": args.dir,
        "disk_free_GB_before": free / 1e9,
        "uptime_before": uptime.stdout.strip(),
        "ram_GB": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9,
        "cpus": os.cpu_count(),
        "machine": platform.node(),
        "torch": torch.__version__,
        "complete": False,
        "methods": [],
        "notes": "peak RSS includes the fp32 global model (4 d bytes) and the pages of the mapped output file "
        "(written during the result pass, then fsynced and renamed); the update file's pages are "
        "dropped before dd, read_path and each method (all start from the disk); floor_s = passes "
        "over U x dd time; FedAWARE's floor_with_table_s adds its table: two reads at the dd rate, one "
        "write at write_GBps. The machine is shared: loadavg_before/after.",
    }
    try:
        t_write = write_updates(path, K, d, dtype)
        res.update(write_s=t_write, write_GBps=size / t_write / 1e9)
        res.update(dd_floor(path))
        res["dd_GBps"] = size / res["dd_s"] / 1e9
        res["fio"] = fio_floor(path, K, size)  # the device's parallel direct-read bandwidth: the honest floor
        rp = read_path(path, K, d, dtype, args.chunk_mb)
        res["read_path"] = dict(rp, vs_dd=res["dd_s"] / rp["read_s"], chunk_MB=args.chunk_mb)
        save(res)
        for m in args.methods:
            drop_cache(path)
            code = (
                f"import json; from bench.large_model import child; print(json.dumps(child({m!r}, {path!r}, "
                f"{K}, {d}, {args.dtype!r}, {args.chunk_mb}, {args.dir!r}, {args.threads})))"
            )
            r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
            if r.returncode != 0:
                raise SystemExit(f"large_model: the {m} round failed:\n{r.stderr[-2000:]}")
            row = json.loads(r.stdout.strip().splitlines()[-1])
            row["floor_s"] = row["passes_over_U"] * res["dd_s"]
            row["vs_floor"] = row["floor_s"] / row["time_s"]
            if "floor_GBps" in res["fio"]:
                row["fio_floor_s"] = row["passes_over_U"] * res["fio"]["floor_s_one_pass"]
                row["vs_fio_floor"] = row["fio_floor_s"] / row["time_s"]
            if row["bytes_written_table"]:
                row["floor_with_table_s"] = row["floor_s"] + 2 * res["dd_s"] + t_write
                row["vs_floor_with_table"] = row["floor_with_table_s"] / row["time_s"]
            res["methods"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "info"}), flush=True)
            for f in junk[1:]:
                if os.path.exists(f):
                    os.remove(f)
            save(res)
    finally:
        for f in junk:
            if os.path.exists(f):
                os.remove(f)
    res["complete"] = True
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d", type=float, default=1e8, help="parameters per client (default 1e8)")
    ap.add_argument("--K", type=int, default=16, help="clients (default 16)")
    ap.add_argument(
        "--dtype",
        choices=sorted(DTYPES) + ["int8", "int8+bf16"],
        default="bf16",
        help="the update file's dtype; int8: compress.kind=int8_block rows (FedAvg only); int8+bf16: "
        "FedAvg on a bf16 file, then on an int8 file, in one run",
    )
    ap.add_argument("--dir", default="/tmp", help="where the temporary files go (deleted at the end)")
    ap.add_argument(
        "--chunk-mb",
        type=int,
        default=CPU_CHUNK_BYTES >> 20,
        help="columns per chunk the aggregators work on, all K rows (MB; default: ChunkedUpdates' CPU "
        "default); the file is read in blocks of at least sources.files.READ_BYTES",
    )
    ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of " + ",".join(METHODS))
    ap.add_argument("--margin-gb", type=float, default=8.0, help="free disk to leave (GB)")
    ap.add_argument(
        "--threads",
        type=int,
        default=torch.get_num_threads(),
        help="torch threads of each round (default: torch's default)",
    )
    ap.add_argument(
        "--append",
        action="store_true",
        help="add this run to the runs of an existing result file instead of replacing it",
    )
    add_out_argument(ap)
    args = ap.parse_args(argv)
    args.methods = [m for m in args.methods.split(",") if m]
    bad = [m for m in args.methods if m not in METHODS]
    if bad or not args.methods:
        ap.error(f"--methods: {bad or args.methods} not in {METHODS}")
    if args.threads < 1:
        ap.error(f"--threads must be >= 1, got {args.threads}")
    if args.d < 1 or args.d != int(args.d) or args.K < 1:
        ap.error(f"--d and --K must be positive integers, got {args.d}, {args.K}")
    if not os.path.isdir(args.dir):
        ap.error(f"--dir: {args.dir!r} is not a directory")
    if args.dtype == "int8+bf16":
        args.methods = ["fedavg"]
    need = (
        args.K * int(args.d) * 1.02
        if args.dtype == "int8"
        else disk_needed(args.K, int(args.d), DTYPES["bf16" if args.dtype == "int8+bf16" else args.dtype], args.methods)
    )
    free = shutil.disk_usage(args.dir).free
    if need + args.margin_gb * 1e9 > free:
        ap.error(
            f"--d {int(args.d)}: --dir {args.dir} has {free / 1e9:.1f} GB free, the run needs "
            f"{need / 1e9:.1f} GB + --margin-gb {args.margin_gb} GB: lower --d"
        )
    path = output_path(args.out, "large-model-cpu.json")
    runs = []
    if args.append and os.path.exists(path):
        with open(path) as f:
            runs = json.load(f)["runs"]

    def save(res):
        with open(path + ".tmp", "w") as f:
            json.dump({"benchmark": "large_model", "runs": runs + [res]}, f, indent=1)
        os.replace(path + ".tmp", path)

    if args.dtype == "int8+bf16":
        save(run_pair(args, save))
    else:
        save(run_int8(args, save) if args.dtype == "int8" else run(args, save))
    print(f"wrote {path}")


def run_pair(args, save=lambda res: None) -> dict:
    """``--dtype int8+bf16``: FedAvg over a bf16 file, then over an int8 file of the same K x d, one record."""
    import copy

    pair = {
        "pair": "int8+bf16",
        "K": args.K,
        "d": int(args.d),
        "complete": False,
        "uptime_before": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
    }
    b = copy.copy(args)
    b.dtype, b.methods = "bf16", ["fedavg"]
    pair["bf16"] = run(b, lambda r: save(dict(pair, bf16=r)))
    save(pair)
    pair["int8"] = run_int8(args, lambda r: save(dict(pair, int8=r)))
    tb, ti = pair["bf16"]["methods"][0]["time_s"], pair["int8"]["methods"][0]["time_s"]
    pair.update(
        int8_vs_bf16=tb / ti,
        uptime_after=subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
        complete=True,
    )
    print(json.dumps({"int8_vs_bf16": pair["int8_vs_bf16"], "bf16_s": tb, "int8_s": ti}), flush=True)
    return pair


if __name__ == "__main__":
    main()


# ---- GPU case: a host matrix streamed through the GPU, copies overlapped ---------------------------------
def gpu_overlap(K: int = 16, d: int = 250_000_000, dtype: str = "fp32", chunk_mb: int = 64, out=None) -> dict:
    """FedAvg over a [K, d] matrix in (pageable) host RAM, delivered to the GPU by
    ``ChunkedUpdates(device="cuda")`` (two pinned staging blocks, a copy stream: ``sources.overlapped``),
    against the measured pinned host-to-device bandwidth (the target: >= 85% of it). Side by
    side: the host copy into pinned memory (the link's other stage), a synchronous chunk loop (each chunk
    ``.to("cuda")`` then the op: the plain-torch way), the CPU op on the same matrix, and what
    ``device="auto"`` picks. On a GPU machine (K x d x itemsize of host RAM: 16 GB by default):

        python -c "from bench.large_model import gpu_overlap; gpu_overlap()"

    Writes runs/bench/large-model-gpu.json (``out``: a directory or a .json path, as --out)."""
    if not torch.cuda.is_available():
        raise SystemExit("gpu_overlap: needs a CUDA device (torch.cuda.is_available() is False)")
    from fedkernels import algorithms, ops, sources
    from fedkernels.sources import ChunkedUpdates, TensorSource

    dt = DTYPES[dtype]
    es = torch.empty(0, dtype=dt).element_size()
    nbytes = K * d * es
    U = torch.empty(K, d, dtype=dt)
    U.fill_(1e-3)
    for k in range(K):  # rows that differ, cheaply
        U[k, k::997] = (k + 1) * 1e-3
    n = [float(k + 1) for k in range(K)]
    p = torch.tensor(n, dtype=torch.float64) / sum(n)
    glob = torch.zeros(d, device="cuda")
    chunk_cols = max(1, (chunk_mb << 20) // (K * es))

    def best(fn, repeats):
        ts = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            r = fn()
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t0)
        return min(ts), r

    agg = algorithms.build("fedavg")
    cu = ChunkedUpdates(U, chunk_cols=chunk_cols, device="cuda")
    agg.aggregate(glob, cu, n)  # warm-up (allocations, streams)
    t_ovl, (new, _) = best(lambda: agg.aggregate(glob, cu, n), 3)

    def sync_loop():
        res = torch.empty(d, device="cuda")
        for a, b, c in TensorSource(U).chunks(chunk_cols):
            res[a:b] = ops.weighted_sum(c.to("cuda").float(), p, base=glob[a:b])
        return res

    t_sync, _ = best(sync_loop, 1)
    g_cpu = glob.cpu()
    t_cpu, ref = best(lambda: ops.weighted_sum(U, p, base=g_cpu), 2)
    h2d, stage, cpu_probe = sources.h2d_gbps(), sources.staging_gbps(), sources.cpu_read_gbps()
    auto = ChunkedUpdates(U, device="auto", method=agg).placement
    auto_kuramoto = ChunkedUpdates(U, device="auto", method=algorithms.build("kuramoto")).placement
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    res = {
        "benchmark": "large_model_gpu",
        "commit": commit.stdout.strip() or None,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "K": K,
        "d": d,
        "dtype": dtype,
        "U_GB": nbytes / 1e9,
        "chunk_MB": K * chunk_cols * es / 2**20,
        "pinned_h2d_GBps": h2d,
        "staging_GBps": stage,
        "cpu_op_probe_GBps": cpu_probe,
        "floor_s": nbytes / 1e9 / h2d,
        "overlapped_s": t_ovl,
        "overlapped_GBps": nbytes / t_ovl / 1e9,
        "overlapped_vs_h2d": nbytes / t_ovl / 1e9 / h2d,
        "target_vs_h2d": 0.85,
        "sync_loop_s": t_sync,
        "sync_loop_GBps": nbytes / t_sync / 1e9,
        "cpu_op_s": t_cpu,
        "cpu_op_GBps": nbytes / t_cpu / 1e9,
        "max_abs_diff_vs_cpu_op": float((new.cpu() - ref).abs().max()),
        "auto_placement": auto,
        "auto_placement_kuramoto": auto_kuramoto,
        "notes": "FedAvg (rows screened in the same pass) over ChunkedUpdates(device='cuda'), global model on the "
        "GPU; best of 3 after a warm-up; the sync loop and the CPU op are the baselines a user would "
        "otherwise write; pinned_h2d/staging/cpu_op_probe are sources' 64 MiB probes (device='auto').",
    }
    for key in (
        "pinned_h2d_GBps",
        "staging_GBps",
        "overlapped_GBps",
        "overlapped_vs_h2d",
        "sync_loop_GBps",
        "cpu_op_GBps",
        "max_abs_diff_vs_cpu_op",
        "auto_placement",
        "auto_placement_kuramoto",
    ):
        print(f"{key}: {res[key]}", flush=True)
    path = output_path(out, "large-model-gpu.json")
    with open(path + ".tmp", "w") as f:
        json.dump(res, f, indent=1)
    os.replace(path + ".tmp", path)
    print(f"wrote {path}")
    return res
