"""``python -m bench.soak ...`` = ``dsa-pd bench soak ...``."""

import sys

from bench.soak.cli import main

sys.exit(main())
