"""``python -m fedkernels ...`` = the ``fedkernels`` command (fedkernels.sim.cli)."""
import sys

from .sim.cli import main

if __name__ == "__main__":
    sys.exit(main())
