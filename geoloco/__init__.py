"""GeoLoCo: SparseLoCo training across regions over slow links (README.md).

Importing the package sets one process default before anything loads torch: torch's
OpenMP threads otherwise spin for a while after every parallel op, holding the core that
the codec's own threads need next (measured: decode + apply 1.5x slower right after a
torch op). A value the user set wins.
"""

import os

OMP_WAIT_POLICY = "OMP_WAIT_POLICY"  # read once, when torch loads its OpenMP runtime

os.environ.setdefault(OMP_WAIT_POLICY, "PASSIVE")
