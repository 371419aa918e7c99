"""``python -m geoloco.worker ARGS`` is ``geoloco worker ARGS``; what torchrun starts for an
island of ranks: ``torchrun --nproc-per-node N -m geoloco.worker --coordinator HOST:PORT``."""

import sys

from geoloco.cli import main

if __name__ == "__main__":  # importing it (a walk over the package's modules) runs nothing
    sys.exit(main(["worker", *sys.argv[1:]]))
