"""Command line: ``fedkernels run|compare|bench|info|presets`` (also ``python -m fedkernels``).

    fedkernels run CONFIG.yaml [key=value ...]            a run from a YAML config
    fedkernels run --preset smoke [key=value ...]          a run from a preset
    fedkernels run --preset kuramoto-fmnist --method fedavg   one of a preset's methods (default: its own)
    fedkernels run --resume runs/NAME [key=value ...]      continue a run from its last checkpoint
    torchrun --nproc_per_node 2 -m fedkernels run --preset smoke --distributed
                                                           ranks train disjoint clients, aggregate slices
    fedkernels compare --preset kuramoto-digits --methods fedavg,kuramoto-S0.5 --seeds 0,1,2 [--rounds N] [--out DIR]
    fedkernels bench --suite cpu|gpu [--quick] [--out DIR] [args ...]   benchmarks (results: runs/bench/)
    fedkernels info                                        build facts, algorithms, datasets, presets
    fedkernels presets                                     the presets and their methods

Overrides are dotted keys parsed as YAML values: ``train.lr=0.05 rounds=20
algorithm.name=kuramoto algorithm.options.kappa0=1.0 partition.options.alpha=0.1``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
from typing import List, Optional, Sequence

from .config import RunConfig, apply_overrides


def _split_args(items: Sequence[str]):
    """(config paths, overrides) from positional arguments; ValueError for a word that is neither
    (``rounds`` without ``=N``)."""
    paths, ovs = [], []
    for it in items:
        if "=" not in it and not os.path.exists(it) and not it.lower().endswith((".yaml", ".yml")):
            raise ValueError(
                f"{it!r} is neither key=value nor a config file: an override needs its value (e.g. {it}=VALUE)"
            )
        (ovs if "=" in it else paths).append(it)
    return paths, ovs


def _choose_threads(cfg: RunConfig) -> Optional[str]:
    """``threads=null`` becomes the count chosen for the machine's current load (provenance.auto_threads),
    written into the config (it is part of the run's identity: another count rounds differently);
    returns why, or None when the config already says. Distributed ranks keep torch's default (each
    rank must name the same run directory)."""
    if cfg.threads is not None or cfg.distributed:
        return None
    from .provenance import auto_threads

    cfg.threads, why = auto_threads(cfg.workers)
    return why


def _base_config(config: Optional[str], preset: Optional[str]) -> RunConfig:
    from . import presets

    if config and preset:
        raise ValueError("give a CONFIG file or --preset, not both")
    if preset:
        return presets.get(preset)
    if config:
        if not os.path.exists(config):
            raise ValueError(f"config file not found: {config}")
        return RunConfig.from_yaml(config)
    raise ValueError("give a CONFIG file, --preset NAME or --resume RUN_DIR")


def _run_config(config: Optional[str], preset: Optional[str], method: Optional[str], ovs: List[str]) -> RunConfig:
    """The config of one run. A preset runs the method its name says, ``--method LABEL`` (or
    ``algorithm.name=LABEL``) one of its methods; a preset whose name says none asks for one."""
    from . import presets

    if method and not preset:
        raise ValueError(
            "--method LABEL picks one of a preset's methods; give --preset too "
            "(or set algorithm.name= and algorithm.options.*)"
        )
    cfg = _base_config(config, preset)
    if not preset:
        return apply_overrides(cfg, ovs)
    labels = presets.variants(preset)
    rest, algo_set = [], False
    for ov in ovs:
        k, _, v = ov.partition("=")
        if k.strip() == "algorithm.name":
            if v.strip() in labels and method is None:
                method = v.strip()
                continue
            algo_set = True
        rest.append(ov)
    if method is None and not algo_set:
        method = presets.default_method(preset)
        if method is None:
            raise ValueError(
                f"preset {preset} compares {len(labels)} methods; choose one with --method LABEL "
                f"({', '.join(labels)}) or run them all with `fedkernels compare --preset {preset}`"
            )
    if method is not None:
        cfg = presets.with_method(cfg, preset, method)
    return apply_overrides(cfg, rest)


def cmd_run(a) -> int:
    from ..errors import RunError
    from .checks import check_run
    from .client_errors import BadClientError
    from .simulation import Simulation

    paths, ovs = _split_args(a.args)
    if len(paths) > 1:
        raise ValueError(f"one CONFIG file expected, got {paths}")
    if a.resume:
        if paths or a.preset or a.method:
            raise ValueError("--resume takes its config from RUN_DIR/config.yaml; give only key=value overrides")
        cfg_path = os.path.join(a.resume, "config.yaml")
        if not os.path.exists(cfg_path):
            raise ValueError(f"--resume: {cfg_path} not found (is {a.resume} a run directory?)")
        old = RunConfig.from_yaml(cfg_path)
        cfg = apply_overrides(old, ovs)
        run_dir = a.resume
    else:
        cfg = _run_config(paths[0] if paths else None, a.preset, a.method, ovs)
        if a.out:
            cfg.out_dir = a.out
        if a.name:
            cfg.name = a.name
        run_dir = None
    if a.no_progress:
        cfg.progress = False
    if a.quiet:
        cfg.verbose = False
    if a.distributed:
        cfg.distributed = True
    why_threads = None if a.resume else _choose_threads(cfg)
    check_run(cfg)  # every key, value and option, before anything is written
    if cfg.distributed:
        from .distributed_sim import DistributedSimulation as Simulation  # noqa: F811
    sim = Simulation(cfg, run_dir=run_dir, resume=bool(a.resume), overwrite=a.overwrite, callbacks=_callbacks(a, cfg))
    sim.threads_choice = why_threads  # provenance.json says how the thread count was chosen
    if why_threads and cfg.verbose and getattr(sim, "rank", 0) == 0:
        print(f"threads: {why_threads}", flush=True)  # information: stdout (stderr is for errors)
    if a.resume and sim.check_resume() is None:  # no checkpoint: CheckpointError, exit 2
        from .checkpoint import check_extension, completed_rounds, resume_note

        done = completed_rounds(run_dir)
        check_extension(run_dir, old.to_dict(), cfg, done)  # the rounds already trained keep their values
        note = resume_note(old.to_dict(), cfg, done)
        if note:
            print(f"note: {note}", file=sys.stderr)
    try:
        s = sim.run()
    except KeyboardInterrupt:
        return 130  # the run printed its one line (checkpoint written)
    except RuntimeError as e:  # a run error (RunError, LostRankError, BadClientError): one line, exit 1
        if not isinstance(e, (RunError, BadClientError)) and type(e).__name__ != "LostRankError":
            raise
        print(f"fedkernels run: error: {e}", file=sys.stderr, flush=True)
        return 1
    if a.quiet and getattr(sim, "rank", 0) == 0:
        print(json.dumps({k: s.get(k) for k in ("final_accuracy", "best_accuracy", "run_dir")}))
    if getattr(sim, "output_errors", None):  # e.g. a full disk at plotting: said, the rest written
        return 1
    return 0 if not s.get("diverged") else 3


def _callbacks(a, cfg: RunConfig) -> list:
    if not getattr(a, "tensorboard", False):
        return []
    from .callbacks import TensorBoardCallback

    return [TensorBoardCallback()]


def cmd_compare(a) -> int:
    from . import presets
    from .compare import compare, resolve_methods

    paths, ovs = _split_args(a.args)
    base = apply_overrides(_base_config(paths[0] if paths else None, a.preset), ovs)
    if a.no_progress:
        base.progress = False
    base.verbose = not a.quiet
    known = presets.variants(a.preset) if a.preset else {}
    labels = [m for m in (a.methods.split(",") if a.methods else list(known) or [base.algorithm.name]) if m]
    methods = resolve_methods(labels, known)  # every method and option checked before any run
    seeds = []
    for s in a.seeds.split(","):
        if s.strip():
            try:
                seeds.append(int(s))
            except ValueError:
                raise ValueError(f"--seeds: {s.strip()!r} is not an integer (e.g. --seeds 0,1,2)") from None
    out = a.out or os.path.join(base.out_dir, f"compare-{a.preset or base.data.name}")
    try:
        res = compare(
            base,
            methods,
            seeds=seeds,
            out_dir=out,
            rounds=a.rounds,
            verbose=True,
            baseline=a.baseline,
            preset=a.preset,
            band=a.band,
        )
    except KeyboardInterrupt:  # the interrupted run printed its line (checkpoint); no later run starts
        print(
            f"fedkernels compare: interrupted; the finished runs are in {out} (no compare tables written); "
            "the same command continues: finished runs are reused, the interrupted one resumes from its "
            "checkpoint",
            file=sys.stderr,
            flush=True,
        )
        return 130
    if not res.get("kept"):
        print(
            f"wrote {os.path.join(out, 'compare.json')}, tables compare.csv/.md/.tex"
            + (
                f" and {res['plot']}"
                if res.get("plot")
                else " (no figure: matplotlib is not installed)"
                if base.plots
                else ""
            )
        )
    if res.get("failed"):
        print(
            f"fedkernels compare: {len(res['failed'])} run(s) failed: "
            + "; ".join(f"{f['method']} seed {f['seed']}" for f in res["failed"]),
            file=sys.stderr,
        )
        return 1
    return 0


def _bench_suite(suite: str):
    """The module ``bench.<suite>`` of the source checkout this fedkernels was imported from (bench/
    beside the fedkernels/ package), from any working directory; None when there is none (an
    installed wheel does not ship bench/). Never a ``bench`` package of the current directory."""
    import fedkernels

    root = os.path.dirname(os.path.dirname(os.path.abspath(fedkernels.__file__)))
    bench_dir = os.path.join(root, "bench")
    if not os.path.isfile(os.path.join(bench_dir, f"{suite}.py")):
        return None
    loaded = sys.modules.get("bench")
    if loaded is not None and os.path.dirname(os.path.abspath(getattr(loaded, "__file__", "") or "")) != bench_dir:
        raise ImportError(f"another module named 'bench' is already imported ({getattr(loaded, '__file__', loaded)})")
    if root not in sys.path:
        sys.path.insert(0, root)
    return importlib.import_module(f"bench.{suite}")


def cmd_bench(a, rest: List[str]) -> int:
    mod = f"bench.{a.suite}"
    try:
        m = _bench_suite(a.suite)
    except ImportError as e:
        print(f"fedkernels bench: the benchmark suite {mod} is not importable ({e})", file=sys.stderr)
        return 2
    if m is None:
        import fedkernels

        print(
            f"fedkernels bench: the benchmark suites are not installed with the package (this fedkernels is "
            f"{os.path.dirname(os.path.abspath(fedkernels.__file__))}); they live in bench/ of a source checkout: "
            f"install that with `pip install --no-build-isolation -e .` and run `fedkernels bench` (or "
            f"`python -m {mod}` in it)",
            file=sys.stderr,
        )
        return 2
    fn = getattr(m, "main", None)
    if fn is None:
        print(f"fedkernels bench: {mod} has no main()", file=sys.stderr)
        return 2
    argv = (["--quick"] if a.quick else []) + ([] if a.out is None else ["--out", a.out]) + list(rest)
    if a.help:  # this command's options, then the suite's own
        a._parser.print_help()
        print(f"\noptions of the suite ({mod}):")
        argv = ["--help"]
    old = sys.argv
    sys.argv = [mod] + argv
    try:
        r = fn()
    except SystemExit as e:  # the suite's argparse: --help (0) or a bad option (2, its message printed)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    finally:
        sys.argv = old
    return int(r or 0) if isinstance(r, (int, type(None))) else 0


def _datasets_found():
    out = {}
    try:
        from . import data
    except ImportError as e:
        return {"error": str(e)}
    for name in getattr(data, "DATASETS", ()):
        try:
            tr, te = data.load_dataset(name, download_hint=True, max_train=10, max_test=10)
            out[name] = f"ok ({tr.meta.get('source', '')})"
        except data.DatasetNotFoundError as e:  # where it was looked for and how to get it
            out[name] = "not found: " + " ".join(str(e).split())
        except Exception as e:  # noqa: BLE001 - report, do not fail
            out[name] = f"unreadable ({type(e).__name__}: {' '.join(str(e).split())})"
    return out


def cmd_info(a) -> int:
    import torch
    import fedkernels
    from .. import algorithms
    from . import presets

    info = {
        "fedkernels": fedkernels.__version__,
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "build_info": fedkernels.build_info(),
        "algorithms": algorithms.available(),
        "presets": presets.names(),
    }
    try:
        from .models import MODELS

        info["models"] = sorted(MODELS)
    except ImportError:
        pass
    info["datasets"] = _datasets_found()
    if a.json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    for k, v in info.items():
        if isinstance(v, dict):
            print(f"{k}:")
            for kk, vv in v.items():
                print(f"  {kk}: {vv}")
            if k == "datasets" and any(str(x).startswith("not found") for x in v.values()):
                print("  (root=DIR above is data.root=DIR in `fedkernels run` overrides or a config's data: section)")
        elif isinstance(v, list):
            print(f"{k}: {', '.join(map(str, v))}")
        else:
            print(f"{k}: {v}")
    return 0


def _duration(sec: float) -> str:
    return f"{sec / 60:.0f} min" if sec >= 90 else f"{sec:.0f} s"


def cmd_presets(a) -> int:
    from . import presets

    for name, doc in presets.describe().items():
        est = presets.estimate(name)
        if est is None:
            t = "not measured on CPU"
        else:
            t = (
                f"~{_duration(est['s_per_run'])} (quiet) to ~{_duration(est['s_per_run_busy'])} (busy) per method "
                f"and seed ({est['s_per_round']:g} s/round x {est['rounds']} rounds on a 2-core CPU, up to "
                f"{presets.BUSY_FACTOR:g}x that when the machine is busy; estimate from {est['source']})"
            )
        default = presets.default_method(name)
        methods = ", ".join(m + (" (default)" if m == default else "") for m in presets.variants(name))
        print(f"{name}\n    {doc}\n    methods: {methods}\n    time: {t}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="fedkernels",
        description="fedkernels federated-learning simulator",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    ap.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    r = sub.add_parser("run", help="one run from a config or preset")
    r.add_argument("args", nargs="*", help="CONFIG.yaml and/or key=value overrides")
    r.add_argument("--preset", help="start from a named preset (see `fedkernels presets`)")
    r.add_argument(
        "--method", metavar="LABEL", help="which of the preset's methods to run (default: the one its name says)"
    )
    r.add_argument("--resume", metavar="RUN_DIR", help="continue RUN_DIR from its last checkpoint")
    r.add_argument("--out", help="output root directory (default: config out_dir, 'runs')")
    r.add_argument("--name", help="run directory name (default: preset-method-seed-confighash)")
    r.add_argument(
        "--overwrite", action="store_true", help="replace a run directory that holds a run with a different config"
    )
    r.add_argument(
        "--tensorboard",
        action="store_true",
        help="log every round's metrics to RUN_DIR/tensorboard (needs the tensorboard package)",
    )
    r.add_argument("--no-progress", action="store_true", help="no progress bars (one line per round instead)")
    r.add_argument("--quiet", action="store_true", help="no per-round lines; print a JSON summary at the end")
    r.add_argument(
        "--distributed",
        action="store_true",
        help="split each round's clients over torch.distributed ranks (launch with torchrun); same as distributed=true",
    )
    c = sub.add_parser("compare", help="several methods x seeds on one setup, with a table")
    c.add_argument("args", nargs="*", help="CONFIG.yaml and/or key=value overrides")
    c.add_argument("--preset", help="start from a named preset (see `fedkernels presets`)")
    c.add_argument("--methods", help="comma-separated: preset variant labels, algorithm names, or algo:key=value")
    c.add_argument("--seeds", default="0", help="comma-separated seeds (default: 0)")
    c.add_argument("--rounds", type=int, help="override the number of rounds")
    c.add_argument("--out", help="output directory (default: OUT_DIR/compare-PRESET)")
    c.add_argument(
        "--baseline",
        help="method label the paired differences are taken against "
        "(default: fedavg when compared, else the first method)",
    )
    c.add_argument(
        "--band",
        choices=("std", "ci", "none"),
        default="std",
        help="band around the mean curve: sample std (default), 95%% CI, or none",
    )
    c.add_argument("--no-progress", action="store_true", help="no progress bars")
    c.add_argument("--quiet", action="store_true", help="no per-round lines")
    b = sub.add_parser(
        "bench",
        help="benchmarks (bench/cpu.py, bench/gpu.py)",
        add_help=False,
        description="Run a benchmark suite of the source checkout (bench/README.md). Other "
        "options go to the suite: `fedkernels bench --suite cpu --help` lists them.",
    )
    b.add_argument("-h", "--help", action="store_true", help="show this help and the suite's options, then exit")
    b.add_argument("--suite", choices=("cpu", "gpu"), default="cpu", help="which benchmark suite (default: cpu)")
    b.add_argument("--quick", action="store_true", help="smaller sizes, fewer repeats (seconds to minutes)")
    b.add_argument(
        "--out",
        metavar="DIR|FILE.json",
        help="where the JSON results go (default: runs/bench/ under the current directory; "
        "`--out bench/results` updates the published results of the checkout)",
    )
    b.set_defaults(_parser=b)
    i = sub.add_parser("info", help="build facts, algorithms, models, datasets, presets")
    i.add_argument("--json", action="store_true", help="machine-readable JSON output")
    sub.add_parser("presets", help="list the presets")
    return ap


def _one_line(e: BaseException) -> str:
    """An error as one line: an OSError as its reason and file (``No space left on device: PATH``)."""
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror}: {e.filename}" if e.filename else e.strerror
    return " ".join(str(e).split())


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = build_parser()
    a, rest = ap.parse_known_args(argv)
    if a.cmd in ("run", "compare"):  # positionals after options (CONFIG, key=value) land in rest
        bad = [x for x in rest if x.startswith("-")]
        if bad:
            ap.error(f"unrecognized arguments: {' '.join(bad)}")
        a.args = list(a.args) + rest
        rest = []
    if rest and a.cmd != "bench":
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    logging.basicConfig(
        level=logging.DEBUG if a.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    from .checkpoint import CheckpointError

    try:
        if a.cmd == "run":
            return cmd_run(a)
        if a.cmd == "compare":
            return cmd_compare(a)
        if a.cmd == "bench":
            return cmd_bench(a, rest)
        if a.cmd == "info":
            return cmd_info(a)
        if a.cmd == "presets":
            return cmd_presets(a)
    except (
        ValueError,
        FileNotFoundError,
        FileExistsError,
        NotADirectoryError,
        IsADirectoryError,
        CheckpointError,
    ) as e:
        print(f"fedkernels {a.cmd}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `fedkernels presets | head`: the reader left; not an error
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except OSError as e:  # the environment (read-only file system, full disk, permissions): exit 1
        print(f"fedkernels {a.cmd}: error: {_one_line(e)}", file=sys.stderr)
        return 1
    return 1


if __name__ == "__main__":
    sys.exit(main())
