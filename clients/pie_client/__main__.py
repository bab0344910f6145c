"""`python -m pie_client` runs the pie-client command line."""

import sys

from .cli import main

sys.exit(main())
