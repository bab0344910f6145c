"""Test helper, not a test: `python stall_server.py MARKER serve ...` runs `pie serve ...` with an
engine whose start stalls for a minute once the model is loaded (as a slow load would), after
writing the file MARKER. Used by tests/service/test_engine_lifetime.py."""

from __future__ import annotations

import functools
import sys

from pie.service import cli
from tests.helpers import stall_start

if __name__ == "__main__":
    sys.exit(cli.main(sys.argv[2:], engine_setup=functools.partial(stall_start, marker=sys.argv[1], seconds=60.0)))
