"""``python -m clusterwatch``."""

import sys

from clusterwatch.cli import main

sys.exit(main())
