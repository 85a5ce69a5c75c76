"""The raw run directories of results/: one archive per setup, read from the archive or from disk.

A *setup* is ``results/<paper>/<setup>/``, the output directory of one ``fedkernels compare``
job (or of several merged ones): its run directories ``<label>-s<seed>/`` (config.yaml,
metrics.jsonl[.gz], summary.json, summary.csv, provenance.json, head_stats.json) and its
``compare.json`` (+ ``compare.csv``/``.md``/``.tex`` where kept). Those raw files are committed as
one archive per setup, ``results/runs/<paper>/<setup>.tar.gz``; the figures (``compare.png``, ...),
``schedule.json`` (the matched controls' config.yaml names it by path) and any other file stay in
``results/<paper>/<setup>/``.

Archive format, deterministic (the same files give the same bytes): the regular files only, named
``<paper>/<setup>/<path>`` (so ``tar xzf ARCHIVE -C results`` unpacks in place), sorted by name,
POSIX.1-2001 (pax) tar, mode 0644, uid/gid 0, no user or group name, mtime 0; gzip level 9 with no
file name and mtime 0 in its header.

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
import os
import tarfile
from typing import Dict, List, Optional

RUN_PATTERN = "*-s[0-9]*"            # a run directory: <label>-s<seed>
RAW_TOP = ("compare.json", "compare.csv", "compare.md", "compare.tex")   # a setup's raw top-level files
ARCHIVES = "runs"                    # results/runs/<paper>/<setup>.tar.gz
SUFFIX = ".tar.gz"
NOT_PACKED = (".pt",)                # model files and checkpoints are never committed (REPORT.md)


def is_run(name: str) -> bool:
    return fnmatch.fnmatchcase(name, RUN_PATTERN)


def _split(setup_dir: str):
    setup_dir = os.path.normpath(setup_dir)
    paper_dir, setup = os.path.split(setup_dir)
    root, paper = os.path.split(paper_dir)
    return root, paper, setup


def archive_path(setup_dir: str) -> str:
    """``<root>/runs/<paper>/<setup>.tar.gz`` of the setup directory ``<root>/<paper>/<setup>``."""
    root, paper, setup = _split(setup_dir)
    return os.path.join(root, ARCHIVES, paper, setup + SUFFIX)


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
        out.update(os.path.join(root, paper, s) for s in os.listdir(pd)
                   if not s.startswith(".") and os.path.isdir(os.path.join(pd, s)))
    ad = os.path.join(root, ARCHIVES)
    if os.path.isdir(ad):
        for paper in os.listdir(ad):
            if os.path.isdir(os.path.join(ad, paper)):
                out.update(os.path.join(root, paper, a[:-len(SUFFIX)]) for a in os.listdir(os.path.join(ad, paper))
                           if a.endswith(SUFFIX))
    return sorted(out)


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
    """{path relative to the setup: bytes} of an archive whose members must all start with ``prefix``."""
    out = {}
    with tarfile.open(path, "r:gz") as tf:
        for m in tf:
            if m.isdir():
                continue
            if not m.isfile() or not m.name.startswith(prefix) or ".." in m.name.split("/"):
                raise ValueError(f"{path}: member {m.name!r} is not a regular file under {prefix!r}")
            out[m.name[len(prefix):]] = tf.extractfile(m).read()
    return out


class Setup:
    """The raw files of one setup, from its archive overlaid by its directory on disk (see the module
    docstring). Paths are relative to the setup directory, with '/' separators."""

    def __init__(self, setup_dir: str):
        self.dir = os.path.normpath(setup_dir)
        root, paper, setup = _split(self.dir)
        self.archive = archive_path(self.dir)
        self.prefix = f"{paper}/{setup}/"
        self._files: Dict[str, Optional[bytes]] = {}     # None: read from disk
        if os.path.exists(self.archive):
            self._files.update(read_archive(self.archive, self.prefix))
        disk = _disk_raw_files(self.dir)
        disk_runs = {f.split("/", 1)[0] for f in disk if "/" in f}
        self.runs_on_disk = sorted(disk_runs)
        self.runs_in_archive = sorted({f.split("/", 1)[0] for f in self._files if "/" in f})
        for f in list(self._files):
            if f.split("/", 1)[0] in disk_runs:
                del self._files[f]
        self._files.update({f: None for f in disk})

    def files(self) -> List[str]:
        return sorted(self._files)

    def runs(self, pattern: str = RUN_PATTERN) -> List[str]:
        """Names of the run directories matching ``pattern`` (a glob pattern), sorted."""
        return sorted({f.split("/", 1)[0] for f in self._files if "/" in f
                       and fnmatch.fnmatchcase(f.split("/", 1)[0], pattern)})

    def exists(self, rel: str) -> bool:
        return rel in self._files

    def read(self, rel: str) -> bytes:
        if rel not in self._files:
            raise FileNotFoundError(f"{os.path.join(self.dir, rel)}: not on disk and not in {self.archive}")
        b = self._files[rel]
        if b is None:
            with open(os.path.join(self.dir, rel), "rb") as f:
                return f.read()
        return b

    def text(self, rel: str) -> str:
        return self.read(rel).decode("utf-8")

    def json(self, rel: str):
        return json.loads(self.read(rel))

    def metrics(self, run: str) -> list:
        """The per-round records of run directory ``run``: metrics.jsonl, else metrics.jsonl.gz; [] if neither."""
        for name, dec in (("metrics.jsonl", lambda b: b), ("metrics.jsonl.gz", gzip.decompress)):
            if self.exists(f"{run}/{name}"):
                txt = dec(self.read(f"{run}/{name}")).decode("utf-8")
                return [json.loads(line) for line in txt.splitlines() if line.strip()]
        return []


_CACHE: Dict[str, Setup] = {}


def open_setup(setup_dir: str, cached: bool = True) -> Setup:
    """:class:`Setup` of ``setup_dir``; ``cached``: one reading per process (for readers like analyze.py)."""
    key = os.path.normpath(os.path.abspath(setup_dir))
    if not cached:
        return Setup(setup_dir)
    if key not in _CACHE:
        _CACHE[key] = Setup(setup_dir)
    return _CACHE[key]


def archive_bytes(files: Dict[str, bytes], prefix: str) -> bytes:
    """The deterministic .tar.gz of ``files`` ({relative path: bytes}) under ``prefix``."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for rel in sorted(files):
            ti = tarfile.TarInfo(prefix + rel)
            ti.size, ti.mtime, ti.mode = len(files[rel]), 0, 0o644
            ti.uid = ti.gid = 0
            ti.uname = ti.gname = ""
            tf.addfile(ti, io.BytesIO(files[rel]))
    out = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", compresslevel=9, fileobj=out, mtime=0) as gz:
        gz.write(raw.getvalue())
    return out.getvalue()


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
            raise ValueError(f"{p}: model/checkpoint files are not committed; run results/analyze.py once "
                             "(it caches head_stats.json), then delete the .pt files and pack again")
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
                os.rmdir(dirpath)     # empty after the removal above; a stray file would raise here
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
        with open(p, "xb") as f:      # never overwrites
            f.write(b)
        written.append(p)
    _CACHE.pop(os.path.normpath(os.path.abspath(setup_dir)), None)
    return written, sorted(kept)
