"""``python -m bench.serve ...`` = ``dsa-pd bench serve ...``."""

import sys

from bench.serve.cli import main

sys.exit(main())
