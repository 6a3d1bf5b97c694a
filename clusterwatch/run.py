"""``python -m clusterwatch.run [torchrun options] SCRIPT [ARGS]``: ``clusterwatch run`` as a module,
for launchers that want one (e.g. ``srun python -m clusterwatch.run ...``)."""

from __future__ import annotations

import sys

from clusterwatch.cli.run_cmd import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
