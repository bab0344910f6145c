"""Test helper, not a test: `python stall_server.py MARKER serve ...` runs `pie serve ...` with an
engine whose start stalls for a minute once the model is loaded (as a slow load would), after
writing the file MARKER. Used by tests/service/test_engine_lifetime.py."""

from __future__ import annotations

import dataclasses
import functools
import sys

from service import cli
from tests.helpers import stall_start


def install_stall(marker: str) -> None:
    make_config = cli._server_config

    def with_stall(args):
        return dataclasses.replace(make_config(args),
                                   engine_setup=functools.partial(stall_start, marker=marker, seconds=60.0))

    cli._server_config = with_stall


if __name__ == "__main__":
    install_stall(sys.argv[1])
    sys.exit(cli.main(sys.argv[2:]))
