"""results/: the raw run directories packed one deterministic archive per setup (results/scripts/runstore.py),
read by results/analyze.py and the scripts directly from the archives."""

from __future__ import annotations

import gzip
import io
import json
import lzma
import os
import subprocess
import sys
import tarfile

import pytest

import cli_process  # tests/cli_process.py: the command in a child forked from a pre-imported interpreter

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(REPO, "results", "scripts")
sys.path.insert(0, SCRIPTS)
import runstore  # noqa: E402


def _run_dir(setup_dir, label, seed, acc, head=None):
    d = os.path.join(setup_dir, f"{label}-s{seed}")
    os.makedirs(d, exist_ok=True)
    rounds = len(acc)
    lines = "".join(json.dumps({"round": r + 1, "accuracy": a, "test_loss": 1.0 - a}) + "\n" for r, a in enumerate(acc))
    with open(os.path.join(d, "metrics.jsonl.gz"), "wb") as f:
        f.write(gzip.compress(lines.encode(), mtime=0))
    with open(os.path.join(d, "summary.json"), "w") as f:
        json.dump({"name": f"{label}-s{seed}", "algorithm": label, "rounds": rounds, "final_accuracy": acc[-1]}, f)
    with open(os.path.join(d, "config.yaml"), "w") as f:
        f.write(f"seed: {seed}\nalgorithm:\n  name: {label}\n  options: {{}}\n")
    if head is not None:
        with open(os.path.join(d, "head_stats.json"), "w") as f:
            json.dump(head, f)
    return d


def _setup(root, paper="fedaware", setup="fmnist", seeds=(0, 1, 2)):
    """A results/<paper>/<setup> as `fedkernels compare` leaves it (+ a figure), 2 methods x seeds."""
    sd = os.path.join(root, paper, setup)
    for i, s in enumerate(seeds):
        _run_dir(sd, "fedavg", s, [0.5, 0.6 + 0.01 * i, 0.7 + 0.01 * s])
        _run_dir(sd, "fedaware", s, [0.5, 0.65 + 0.02 * i, 0.72 + 0.013 * s], head={"w": 0.1 * s})
    with open(os.path.join(sd, "compare.json"), "w") as f:
        json.dump(
            {
                "setup": {"num_clients": 10, "data": {"name": "fmnist"}},
                "rounds": 3,
                "seeds": list(seeds),
                "methods": {
                    "fedavg": {"algorithm": "fedavg", "options": {}},
                    "fedaware": {"algorithm": "fedaware", "options": {}},
                },
            },
            f,
        )
    with open(os.path.join(sd, "compare.png"), "wb") as f:
        f.write(b"\x89PNG not packed")
    return sd


def _tree(d):
    out = {}
    for dp, _, fs in os.walk(d):
        for f in fs:
            with open(os.path.join(dp, f), "rb") as fh:
                out[os.path.relpath(os.path.join(dp, f), d)] = fh.read()
    return out


def _stored(tree):
    """A run directory's files as the archive stores them (and every reader sees them): X.gz as X, gunzipped."""
    return {
        (k[:-3] if k.endswith(".gz") else k): (gzip.decompress(v) if k.endswith(".gz") else v) for k, v in tree.items()
    }


def test_pack_is_deterministic_and_archive_reads_like_the_directory(tmp_path):
    sd = _setup(str(tmp_path / "results"))
    raw = _stored({k: v for k, v in _tree(sd).items() if k != "compare.png"})
    assert "fedavg-s0/metrics.jsonl" in raw and not any(k.endswith(".gz") for k in raw)
    arc = runstore.pack(sd, remove=False)
    assert arc == os.path.join(str(tmp_path), "results", "runs", "fedaware", "fmnist.tar.xz")
    first = open(arc, "rb").read()
    for i, (dp, _, fs) in enumerate(os.walk(sd)):  # other mtimes and modes: the same bytes
        for f in fs:
            os.utime(os.path.join(dp, f), (1e9 + i, 1e9 + i))
            os.chmod(os.path.join(dp, f), 0o600)
    os.remove(arc)
    assert runstore.pack(sd, remove=True) == arc and open(arc, "rb").read() == first
    assert first[:8] == b"\xfd7zXZ\0\0\x04"  # xz stream header, CRC64 check
    with tarfile.open(arc, "r:xz") as tf:
        ms = tf.getmembers()
        assert [m.name for m in ms] == sorted(m.name for m in ms) == sorted("fedaware/fmnist/" + k for k in raw)
        assert {(m.mtime, m.uid, m.gid, m.uname, m.gname, m.mode, m.type) for m in ms} == {
            (0, 0, 0, "", "", 0o644, tarfile.REGTYPE)
        }
    assert sorted(os.listdir(sd)) == ["compare.png"]  # run directories and compare.json packed and removed
    s = runstore.Setup(sd)
    assert s.runs() == sorted(f"{m}-s{x}" for m in ("fedavg", "fedaware") for x in (0, 1, 2))
    assert {f: s.read(f) for f in s.files()} == raw
    assert s.metrics("fedavg-s2")[-1] == {"round": 3, "accuracy": 0.72, "test_loss": 1.0 - 0.72}
    out = tmp_path / "tar"  # `tar xJf ARCHIVE -C results` unpacks in place
    with tarfile.open(arc) as tf:
        tf.extractall(out, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    assert _tree(str(out / "fedaware" / "fmnist")) == raw
    assert runstore.unpack(sd)[0] and {k: v for k, v in _tree(sd).items() if k != "compare.png"} == raw


def test_disk_runs_overlay_the_archive(tmp_path):
    sd = _setup(str(tmp_path / "results"), seeds=(0, 1))
    runstore.pack(sd)
    _run_dir(sd, "fedaware", 1, [0.1, 0.2])  # a re-run replaces the archived run as a whole
    _run_dir(sd, "fedavg", 2, [0.3])  # a new seed is added
    s = runstore.Setup(sd)
    assert s.runs("fedavg-s*") == ["fedavg-s0", "fedavg-s1", "fedavg-s2"] and s.runs("fedaware-s*") == [
        "fedaware-s0",
        "fedaware-s1",
    ]
    assert [r["accuracy"] for r in s.metrics("fedaware-s1")] == [0.1, 0.2]
    assert not s.exists("fedaware-s1/head_stats.json") and s.json("fedaware-s0/head_stats.json") == {"w": 0.0}
    with pytest.raises(FileNotFoundError, match="not on disk and not in"):
        s.read("fedavg-s9/summary.json")


def test_pack_keeps_archived_runs_and_unpack_never_overwrites(tmp_path):
    sd = _setup(str(tmp_path / "results"), seeds=(0, 1))
    arc = runstore.pack(sd)
    _run_dir(sd, "fedavg", 2, [0.3])  # a new seed, packed without unpacking
    _run_dir(sd, "fedaware", 1, [0.1, 0.2])  # a re-run: replaces the archived run as a whole
    assert runstore.pack(sd) == arc and sorted(os.listdir(sd)) == ["compare.png"]
    s = runstore.Setup(sd)
    assert s.runs() == ["fedavg-s0", "fedavg-s1", "fedavg-s2", "fedaware-s0", "fedaware-s1"]
    assert [r["accuracy"] for r in s.metrics("fedaware-s1")] == [0.1, 0.2]
    assert not s.exists("fedaware-s1/head_stats.json") and s.exists("compare.json")
    wrote, kept = runstore.unpack(sd)
    assert len(wrote) == 17 and kept == []  # 5 runs x 3 files, fedaware-s0's head stats, compare.json
    p = os.path.join(sd, "fedavg-s0", "summary.json")
    with open(p, "w") as f:
        f.write("{}")
    os.remove(os.path.join(sd, "compare.json"))
    assert runstore.unpack(sd) == ([os.path.join(sd, "compare.json")], s.runs())
    assert open(p).read() == "{}"  # the run on disk is left alone
    with open(os.path.join(sd, "fedavg-s0", "final_model.pt"), "wb") as f:
        f.write(b"x")
    with pytest.raises(ValueError, match="final_model.pt: model/checkpoint files are not committed"):
        runstore.pack(sd)


def _cli(script, *args, cwd=REPO, env=None):
    return cli_process.run(
        [sys.executable, os.path.join(SCRIPTS, script), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_cli_bad_input_is_one_line_exit_2(tmp_path):
    sd = _setup(str(tmp_path / "results"), seeds=(0,))
    for script, args, want in (
        ("pack_runs.py", [str(tmp_path / "nope")], "is not a directory"),
        ("pack_runs.py", [str(tmp_path / "results" / "fedaware")], "holds no run directory"),
        ("unpack.py", [sd], "has no archive"),
    ):
        r = _cli(script, *args)
        assert r.returncode == 2 and want in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert os.path.isdir(os.path.join(sd, "fedavg-s0"))
    r = _cli("pack_runs.py", sd)
    assert r.returncode == 0 and not os.path.exists(os.path.join(sd, "fedavg-s0"))
    r = _cli("unpack.py", sd)
    assert r.returncode == 0 and os.path.isfile(os.path.join(sd, "fedavg-s0", "summary.json"))


def test_merge_setups_on_archived_setups(tmp_path):
    root = str(tmp_path / "results")
    dst = _setup(root, setup="T500", seeds=(0, 1))
    src = _setup(root, setup="T500-s23", seeds=(2, 3))
    runstore.pack(dst)
    runstore.pack(src)
    r = _cli("merge_setups.py", src, dst, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert not os.path.exists(src) and not os.path.exists(runstore.archive_path(src))
    assert sorted(os.listdir(dst)) == []  # repacked; the stale compare.json/.png are gone
    s = runstore.Setup(dst)
    assert s.runs("fedavg-s*") == [f"fedavg-s{x}" for x in range(4)] and not s.exists("compare.json")


def test_analyze_reads_archives_byte_identical_to_directories(tmp_path):
    root = str(tmp_path / "results")
    _setup(root)
    _setup(root, paper="gcfed", setup="digits", seeds=(0, 1))
    env = dict(os.environ, RESULTS_ROOT=root, PYTHONPATH=REPO)
    outs = []
    for step in ("directories", "archives"):
        if step == "archives":
            for sd in runstore.setup_dirs(root):
                runstore.pack(sd)
            assert not any(
                runstore.is_run(n)
                for p in ("fedaware/fmnist", "gcfed/digits")
                for n in os.listdir(os.path.join(root, p))
            )
        r = cli_process.run(
            [sys.executable, os.path.join(REPO, "results", "analyze.py")],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0, r.stderr
        outs.append(
            (
                lzma.open(os.path.join(root, "summary.json.xz")).read(),
                open(os.path.join(root, "tables.md"), "rb").read(),
            )
        )
    assert outs[0] == outs[1]
    summ = json.loads(outs[1][0])
    assert summ["fedaware/fmnist"]["methods"]["fedaware"]["per_seed"][2]["final"] == pytest.approx(0.72 + 0.026)
    assert summ["fedaware/fmnist"]["baseline"] == "fedaware/fmnist/fedavg"


def test_committed_archives_are_what_pack_runs_writes():
    """Every results/runs archive holds, under its setup's prefix, uncompressed members in the tar that
    pack_runs writes for them (byte for byte); the smallest ones re-pack to the same .tar.xz bytes (xz
    at preset 9e takes seconds per MB: the others are only decompressed, to keep the suite fast)."""
    root = os.path.join(REPO, "results")
    arcs = [d for d in runstore.setup_dirs(root) if os.path.exists(runstore.archive_path(d))]
    if not arcs:
        pytest.skip("no committed archives in this checkout")
    assert not [p for p in os.listdir(os.path.join(root, "runs", "fedaware")) if not p.endswith(runstore.SUFFIX)]
    arcs.sort(key=lambda d: os.path.getsize(runstore.archive_path(d)))
    for i, d in enumerate(arcs):
        _, paper, setup = runstore._split(d)
        prefix = f"{paper}/{setup}/"
        data = open(runstore.archive_path(d), "rb").read()
        files = runstore.read_archive(runstore.archive_path(d), prefix)  # refuses gzipped members
        assert data[:8] == b"\xfd7zXZ\0\0\x04", d  # xz, CRC64
        assert lzma.decompress(data) == runstore.tar_bytes(files, prefix), d
        if i < 3:
            assert runstore.archive_bytes(files, prefix) == data, d
        assert any(runstore.is_run(f.split("/", 1)[0]) for f in files), d


def test_gz_on_disk_reads_as_its_stored_name_and_bad_layouts_are_refused(tmp_path):
    """A run's metrics.jsonl.gz reads (and packs) as metrics.jsonl; both at once, a broken .gz, a gzipped
    archive member and an archive in the old .tar.gz format are each one ValueError naming the file."""
    sd = _setup(str(tmp_path / "results"), seeds=(0,))
    s = runstore.Setup(sd)
    assert s.exists("fedavg-s0/metrics.jsonl") and not s.exists("fedavg-s0/metrics.jsonl.gz")
    assert [r["accuracy"] for r in s.metrics("fedavg-s0")] == [0.5, 0.6, 0.7]
    run = os.path.join(sd, "fedavg-s0")
    with open(os.path.join(run, "metrics.jsonl"), "w") as f:
        f.write("{}\n")
    with pytest.raises(ValueError, match="both metrics.jsonl and metrics.jsonl.gz on disk"):
        runstore.Setup(sd)
    os.remove(os.path.join(run, "metrics.jsonl"))
    with open(os.path.join(run, "summary.json.gz"), "wb") as f:
        f.write(b"not gzip")
    os.remove(os.path.join(run, "summary.json"))
    with pytest.raises(ValueError, match=r"summary.json.gz: .*expected a gzip file"):
        runstore.pack(sd)
    assert os.path.isdir(run) and not os.path.exists(runstore.archive_path(sd))  # nothing written or removed
    os.remove(os.path.join(run, "summary.json.gz"))
    arc = runstore.pack(sd)
    files = runstore.read_archive(arc, "fedaware/fmnist/")
    bad = runstore.tar_bytes({**files, "fedavg-s0/x.gz": gzip.compress(b"x")}, "fedaware/fmnist/")
    with open(arc, "wb") as f:
        f.write(lzma.compress(bad, **runstore.XZ))
    with pytest.raises(ValueError, match=r"member 'fedaware/fmnist/fedavg-s0/x.gz' is gzipped"):
        runstore.Setup(sd)
    os.rename(arc, arc[: -len(runstore.SUFFIX)] + ".tar.gz")
    for f in (runstore.Setup, lambda d: runstore.setup_dirs(os.path.dirname(os.path.dirname(d)))):
        with pytest.raises(
            ValueError, match=r"fmnist.tar.gz: an archive in the old format \(.tar.gz\); expected .tar.xz"
        ):
            f(sd)
    _run_dir(sd, "fedavg", 1, [0.3])
    r = _cli("pack_runs.py", sd)
    assert r.returncode == 2 and "old format" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_shrink_png_keeps_the_figure(tmp_path):
    """The committed figures are palette PNGs: same pixel size and dpi, colours within a few levels, fewer bytes."""
    np = pytest.importorskip("numpy")
    Image = pytest.importorskip("PIL.Image")
    plt = pytest.importorskip("matplotlib.pyplot")
    from plot_curves import shrink_png

    fig, ax = plt.subplots(figsize=(6, 4))
    x = np.linspace(0, 10, 400)
    for k in range(6):
        ax.plot(x, np.sin(x + k), marker="o", markevery=40, label=f"m{k}")
        ax.fill_between(x, np.sin(x + k) - 0.2, np.sin(x + k) + 0.2, alpha=0.15)
    ax.legend()
    p = str(tmp_path / "f.png")
    fig.savefig(p, dpi=150)
    plt.close(fig)
    before, size = np.asarray(Image.open(p).convert("RGB"), dtype=int), os.path.getsize(p)
    assert shrink_png(p) == p
    im = Image.open(p)
    assert im.mode == "P" and im.size == (900, 600) and round(im.info["dpi"][0]) == 150
    assert np.abs(np.asarray(im.convert("RGB"), dtype=int) - before).mean() < 1.0
    assert os.path.getsize(p) < 0.7 * size
