"""The raw run directories of results/: one archive per setup, read from the archive or from disk.

A *setup* is ``results/<paper>/<setup>/``, the output directory of one ``fedkernels compare``
job (or of several merged ones): its run directories ``<label>-s<seed>/`` (config.yaml,
metrics.jsonl[.gz], summary.json, summary.csv, provenance.json, head_stats.json) and its
``compare.json`` (+ ``compare.csv``/``.md``/``.tex`` where kept). Those raw files are committed as
one archive per setup, ``results/runs/<paper>/<setup>.tar.xz``; the figures (``compare.png``, ...),
``schedule.json`` (the matched controls' config.yaml names it by path) and any other file stay in
``results/<paper>/<setup>/``.

Archive format, deterministic (the same files give the same bytes): the regular files only, named
``<paper>/<setup>/<path>`` (so ``tar xJf ARCHIVE -C results`` unpacks in place), sorted by name,
POSIX.1-2001 (pax) tar, mode 0644, uid/gid 0, no user or group name, mtime 0; the members are
uncompressed (a file ``X.gz`` on disk, e.g. a gzipped ``metrics.jsonl.gz``, is stored as ``X``, its
gunzipped bytes: the archive is compressed as a whole, which finds what the runs of a setup share);
the tar compressed by xz (LZMA2 preset 9 extreme, CRC64 check; Python's ``lzma``). This is about a
quarter smaller than gzipping each log and the tar again.

Names: every reader sees a file ``X.gz`` on disk as ``X`` (gunzipped), like the archive stores it,
so ``run/metrics.jsonl`` is the one name of a run's per-round log, however it was kept.

Reading (:class:`Setup`): the archive's files, overlaid by the files on disk: a run directory on
disk replaces the archive's run of the same name as a whole, and a raw top-level file on disk
(compare.json, ...) replaces the archive's. So a freshly run setup (no archive), an archived one (no
run directories on disk) and an unpacked or extended one read alike; nothing is extracted to disk.
:func:`pack` writes exactly that view (so re-running or adding some runs on disk and packing keeps
the other archived runs); :func:`unpack` writes the archived runs that are not on disk.
"""

from __future__ import annotations

import fnmatch
import gzip
import io
import json
import lzma
import os
import tarfile
from typing import Dict, List, Optional, Union

RUN_PATTERN = "*-s[0-9]*"  # a run directory: <label>-s<seed>
RAW_TOP = ("compare.json", "compare.csv", "compare.md", "compare.tex")  # a setup's raw top-level files
ARCHIVES = "runs"  # results/runs/<paper>/<setup>.tar.xz
SUFFIX = ".tar.xz"
XZ = dict(format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, preset=9 | lzma.PRESET_EXTREME)
OLD_SUFFIX = ".tar.gz"  # the older format (gzipped members, gzip): refused, never read
NOT_PACKED = (".pt",)  # model files and checkpoints are never committed (REPORT.md)


def is_run(name: str) -> bool:
    return fnmatch.fnmatchcase(name, RUN_PATTERN)


def _split(setup_dir: str):
    setup_dir = os.path.normpath(setup_dir)
    paper_dir, setup = os.path.split(setup_dir)
    root, paper = os.path.split(paper_dir)
    return root, paper, setup


def archive_path(setup_dir: str) -> str:
    """``<root>/runs/<paper>/<setup>.tar.xz`` of the setup directory ``<root>/<paper>/<setup>``."""
    root, paper, setup = _split(setup_dir)
    return os.path.join(root, ARCHIVES, paper, setup + SUFFIX)


def refuse_old_archive(path: str):
    """Raises ValueError on ``path`` if it is an archive in the old format (<setup>.tar.xz), which no
    reader reads (a stale one would otherwise be skipped silently), saying how to convert it."""
    if path.endswith(OLD_SUFFIX):
        root = os.path.dirname(os.path.dirname(os.path.dirname(path)))
        setup_dir = os.path.join(
            root, os.path.basename(os.path.dirname(path)), os.path.basename(path)[: -len(OLD_SUFFIX)]
        )
        raise ValueError(
            f"{path}: an archive in the old format ({OLD_SUFFIX}); expected {SUFFIX}: convert it with "
            f"`tar xzf {path} -C {root}`, delete it, then `python results/scripts/pack_runs.py {setup_dir}`"
        )


def setups_from_cli(doc: str, all_help: str, argv=None, extra=()):
    """The command line shared by pack_runs.py and unpack.py: ``SETUP_DIR ...`` or ``--all`` (plus
    ``extra`` flags: (name, help) store_true pairs) -> (parsed arguments, the results directory)."""
    import argparse

    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("setups", nargs="*", metavar="SETUP_DIR")
    ap.add_argument("--all", action="store_true", help=all_help)
    for name, help_ in extra:
        ap.add_argument(name, action="store_true", help=help_)
    a = ap.parse_args(argv)
    if bool(a.setups) == a.all:
        ap.error("give SETUP_DIR ... or --all (not both)")
    return a, os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def setup_dirs(root: str) -> List[str]:
    """Every setup under ``root`` (a results directory): ``root/<paper>/<setup>`` for each directory
    on disk and each archive, sorted; the archives' folder itself is not a paper."""
    out = set()
    for paper in os.listdir(root):
        pd = os.path.join(root, paper)
        if paper == ARCHIVES or paper.startswith(".") or not os.path.isdir(pd):
            continue
        out.update(
            os.path.join(root, paper, s)
            for s in os.listdir(pd)
            if not s.startswith(".") and os.path.isdir(os.path.join(pd, s))
        )
    ad = os.path.join(root, ARCHIVES)
    if os.path.isdir(ad):
        for paper in os.listdir(ad):
            if os.path.isdir(os.path.join(ad, paper)):
                for a in os.listdir(os.path.join(ad, paper)):
                    refuse_old_archive(os.path.join(ad, paper, a))
                out.update(
                    os.path.join(root, paper, a[: -len(SUFFIX)])
                    for a in os.listdir(os.path.join(ad, paper))
                    if a.endswith(SUFFIX)
                )
    return sorted(out)


def stored_name(rel: str) -> str:
    """The name a raw file on disk has for the readers and in the archive: ``X.gz`` -> ``X``."""
    return rel[:-3] if rel.endswith(".gz") else rel


def _disk_raw_files(setup_dir: str) -> List[str]:
    """The raw files of a setup directory on disk (run directories' files, RAW_TOP), relative, sorted."""
    out = []
    if not os.path.isdir(setup_dir):
        return out
    for name in sorted(os.listdir(setup_dir)):
        p = os.path.join(setup_dir, name)
        if is_run(name) and os.path.isdir(p):
            for dirpath, dirnames, filenames in os.walk(p):
                dirnames.sort()
                for f in filenames:
                    out.append(os.path.relpath(os.path.join(dirpath, f), setup_dir).replace(os.sep, "/"))
        elif name in RAW_TOP and os.path.isfile(p):
            out.append(name)
    return sorted(out)


def read_archive(path: str, prefix: str) -> Dict[str, bytes]:
    """{path relative to the setup: bytes} of an archive whose members must all be uncompressed regular
    files under ``prefix``."""
    out = {}
    with tarfile.open(path, "r:xz") as tf:
        for m in tf:
            if m.isdir():
                continue
            if not m.isfile() or not m.name.startswith(prefix) or ".." in m.name.split("/"):
                raise ValueError(f"{path}: member {m.name!r} is not a regular file under {prefix!r}")
            if stored_name(m.name) != m.name:
                raise ValueError(
                    f"{path}: member {m.name!r} is gzipped; expected uncompressed members "
                    "(pack_runs.py stores X.gz as X)"
                )
            out[m.name[len(prefix) :]] = tf.extractfile(m).read()
    return out


class Setup:
    """The raw files of one setup, from its archive overlaid by its directory on disk (see the module
    docstring). Paths are relative to the setup directory, with '/' separators."""

    def __init__(self, setup_dir: str):
        self.dir = os.path.normpath(setup_dir)
        root, paper, setup = _split(self.dir)
        self.archive = archive_path(self.dir)
        self.prefix = f"{paper}/{setup}/"
        if os.path.exists(self.archive[: -len(SUFFIX)] + OLD_SUFFIX):
            refuse_old_archive(self.archive[: -len(SUFFIX)] + OLD_SUFFIX)
        self._files: Dict[str, Union[bytes, str]] = {}  # the bytes, or (str) the file on disk to read
        if os.path.exists(self.archive):
            self._files.update(read_archive(self.archive, self.prefix))
        disk = _disk_raw_files(self.dir)
        disk_runs = {f.split("/", 1)[0] for f in disk if "/" in f}
        self.runs_on_disk = sorted(disk_runs)
        self.runs_in_archive = sorted({f.split("/", 1)[0] for f in self._files if "/" in f})
        for f in list(self._files):
            if f.split("/", 1)[0] in disk_runs:
                del self._files[f]
        on_disk: Dict[str, str] = {}
        for f in disk:
            name = stored_name(f)
            if name in on_disk:
                base = os.path.basename(name)
                raise ValueError(
                    f"{os.path.join(self.dir, name)}: both {base} and {base}.gz on disk; expected one of them"
                )
            on_disk[name] = f
        self._files.update(on_disk)

    def files(self) -> List[str]:
        return sorted(self._files)

    def runs(self, pattern: str = RUN_PATTERN) -> List[str]:
        """Names of the run directories matching ``pattern`` (a glob pattern), sorted."""
        return sorted(
            {f.split("/", 1)[0] for f in self._files if "/" in f and fnmatch.fnmatchcase(f.split("/", 1)[0], pattern)}
        )

    def exists(self, rel: str) -> bool:
        return rel in self._files

    def read(self, rel: str) -> bytes:
        if rel not in self._files:
            raise FileNotFoundError(f"{os.path.join(self.dir, rel)}: not on disk and not in {self.archive}")
        b = self._files[rel]
        if isinstance(b, str):
            p = os.path.join(self.dir, b)
            with open(p, "rb") as f:
                data = f.read()
            if b == rel:
                return data
            try:
                return gzip.decompress(data)
            except (OSError, EOFError) as e:
                raise ValueError(f"{p}: {e}; expected a gzip file (read as {rel}, gunzipped)") from None
        return b

    def text(self, rel: str) -> str:
        return self.read(rel).decode("utf-8")

    def json(self, rel: str):
        return json.loads(self.read(rel))

    def metrics(self, run: str) -> list:
        """The per-round records of run directory ``run`` (its metrics.jsonl, or .gz on disk); [] if none."""
        if not self.exists(f"{run}/metrics.jsonl"):
            return []
        return [json.loads(line) for line in self.text(f"{run}/metrics.jsonl").splitlines() if line.strip()]


_CACHE: Dict[str, Setup] = {}


def open_setup(setup_dir: str, cached: bool = True) -> Setup:
    """:class:`Setup` of ``setup_dir``; ``cached``: one reading per process (for readers like analyze.py)."""
    key = os.path.normpath(os.path.abspath(setup_dir))
    if not cached:
        return Setup(setup_dir)
    if key not in _CACHE:
        _CACHE[key] = Setup(setup_dir)
    return _CACHE[key]


def tar_bytes(files: Dict[str, bytes], prefix: str) -> bytes:
    """The deterministic tar (uncompressed) of ``files`` ({relative path: bytes}) under ``prefix``."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for rel in sorted(files):
            ti = tarfile.TarInfo(prefix + rel)
            ti.size, ti.mtime, ti.mode = len(files[rel]), 0, 0o644
            ti.uid = ti.gid = 0
            ti.uname = ti.gname = ""
            tf.addfile(ti, io.BytesIO(files[rel]))
    return raw.getvalue()


def archive_bytes(files: Dict[str, bytes], prefix: str) -> bytes:
    """The deterministic .tar.xz of ``files`` ({relative path: bytes}, names as stored) under ``prefix``."""
    return lzma.compress(tar_bytes(files, prefix), **XZ)


def pack(setup_dir: str, remove: bool = True) -> Optional[str]:
    """Packs the setup as the readers see it (its archive's runs overlaid by the run directories on
    disk: a run re-run or added on disk replaces or joins the archived ones, the others are kept, so
    nothing is lost) into its archive, checks the archive reads back byte-identical, and with
    ``remove`` deletes the packed files and run directories from disk. Returns the archive path, or
    None when no run directory is on disk (nothing to pack). Raises ValueError (naming the file) on a
    model/checkpoint file (.pt), a link or a file that is not plain, before writing anything."""
    setup_dir = os.path.normpath(setup_dir)
    rels = _disk_raw_files(setup_dir)
    if not any("/" in r for r in rels):
        return None
    for rel in rels:
        p = os.path.join(setup_dir, rel)
        if os.path.islink(p) or not os.path.isfile(p):
            raise ValueError(f"{p}: a link or not a plain file; expected plain files only in a run directory")
        if rel.endswith(NOT_PACKED):
            raise ValueError(
                f"{p}: model/checkpoint files are not committed; run results/analyze.py once "
                "(it caches head_stats.json), then delete the .pt files and pack again"
            )
    view = Setup(setup_dir)
    files = {rel: view.read(rel) for rel in view.files()}
    arc = view.archive
    data = archive_bytes(files, view.prefix)
    os.makedirs(os.path.dirname(arc), exist_ok=True)
    tmp = arc + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    if read_archive(tmp, view.prefix) != files:
        os.remove(tmp)
        raise ValueError(f"{arc}: the archive does not read back as the files of {setup_dir}; nothing removed")
    os.replace(tmp, arc)
    if remove:
        for rel in rels:
            os.remove(os.path.join(setup_dir, rel))
        for run in sorted({r.split("/", 1)[0] for r in rels if "/" in r}):
            for dirpath, _, _ in sorted(os.walk(os.path.join(setup_dir, run)), key=lambda t: -len(t[0])):
                os.rmdir(dirpath)  # empty after the removal above; a stray file would raise here
    _CACHE.pop(os.path.normpath(os.path.abspath(setup_dir)), None)
    return arc


def unpack(setup_dir: str):
    """Writes the archived runs (and raw top-level files) of ``setup_dir`` that are not on disk into
    the directory, for inspecting or extending them; a run directory or file already on disk takes
    precedence (as when reading) and is left alone, so nothing on disk is overwritten. Returns
    (paths written, names on disk that were kept instead of the archive's)."""
    setup_dir = os.path.normpath(setup_dir)
    view = Setup(setup_dir)
    if not os.path.exists(view.archive):
        raise ValueError(f"setup={setup_dir!r}: no archive {view.archive}")
    disk = set(_disk_raw_files(setup_dir))
    shadowing = set(view.runs_on_disk) | {f for f in disk if "/" not in f}
    written, kept = [], set()
    for rel, b in sorted(read_archive(view.archive, view.prefix).items()):
        top = rel.split("/", 1)[0]
        if top in shadowing:
            kept.add(top)
            continue
        p = os.path.join(setup_dir, rel)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "xb") as f:  # never overwrites
            f.write(b)
        written.append(p)
    _CACHE.pop(os.path.normpath(os.path.abspath(setup_dir)), None)
    return written, sorted(kept)
