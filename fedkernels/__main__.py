"""``python -m fedkernels ...`` = the ``fedkernels`` command (fedkernels.sim.cli)."""

from __future__ import annotations

import importlib
import sys
from typing import List, Optional

# the simulator's third-party modules (the `sim` extra); the library itself needs only torch and numpy
SIM_MODULES = {"yaml": "pyyaml", "tqdm": "tqdm"}


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of the ``fedkernels`` command: one line and exit 2 when the `sim` extra is missing."""
    missing = []
    for mod, pkg in SIM_MODULES.items():
        try:
            importlib.import_module(mod)
        except ImportError:
            missing.append(pkg)
    if missing:
        print(
            f"fedkernels: the command needs the simulator extra (missing {', '.join(missing)}): "
            "pip install --no-build-isolation '.[sim]' (or pip install " + " ".join(missing) + ")",
            file=sys.stderr,
        )
        return 2
    from .sim.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
