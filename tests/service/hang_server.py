"""Test helper, not a test: `python hang_server.py N serve ...` runs `pie serve ...` with a model
runner whose step N+1 (and every later one) blocks forever, to exercise the step watchdog in a
real process. Used by tests/service/test_reliability.py."""

from __future__ import annotations

import sys
import threading

from pie.engine.runner.model_runner import ModelRunner
from pie.service.cli import main


def install_hang(after_steps: int) -> None:
    original = ModelRunner.launch
    calls = [0]
    never = threading.Event()

    def launch(self, out):
        calls[0] += 1
        if calls[0] > after_steps:
            never.wait()
        return original(self, out)

    ModelRunner.launch = launch


if __name__ == "__main__":
    install_hang(int(sys.argv[1]))
    sys.exit(main(sys.argv[2:]))
