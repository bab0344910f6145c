"""What the benchmark scripts share: their flags' parser, the flags whose default depends on
--tiny, the default device, and the refusal of the GPU-only scripts on a machine without CUDA.

Not a script (no `__main__` block), so `pie bench` does not list it. Importing it loads
service.cli (for the help formatter) and torch, never CUDA: every script builds and parses its
flags before it touches a device, so `--help` works on any machine.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch

from pie.service.help_format import HelpFormatter

DEVICE_HELP = "device to run on: cpu or cuda (default: cuda where a CUDA GPU is visible, else cpu)"


def make_parser(description: str | None) -> argparse.ArgumentParser:
    """A script's parser: the description keeps its line breaks, and every flag's help ends with
    its default, once (service.help_format.HelpFormatter)."""
    return argparse.ArgumentParser(description=description, formatter_class=HelpFormatter)


def default_device() -> str:
    """What --device means when not given."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def require_cuda(parser: argparse.ArgumentParser) -> None:
    """For a GPU-only script (`NEEDS_GPU = True`), once its flags are parsed: where no CUDA GPU is
    visible, one line on stderr and exit status 2, before any work."""
    if not torch.cuda.is_available():
        parser.exit(2, f"{parser.prog}: this benchmark needs a CUDA GPU and none is visible "
                       "(torch.cuda.is_available() is False)\n")


class SizedFlags:
    """Flags whose default depends on --tiny, on the one parser (so --help lists every flag): each
    is added with default None and the help "(default: FULL; TINY with --tiny)", and `fill`
    writes the default of the chosen size into the flags left out after parsing."""

    def __init__(self, parser: argparse.ArgumentParser, switch: str = "--tiny") -> None:
        self._parser = parser
        self._switch = switch
        self._defaults: dict[str, tuple[Any, Any]] = {}  # dest -> (full-size default, tiny default)

    def add(self, flag: str, full: Any, tiny: Any, help: str, *, type: Callable[[str], Any] = int,
            shown: tuple[str, str] | None = None, **kwargs: Any) -> None:
        """`shown`: the two defaults in words, where their values read badly (None, bytes)."""
        full_text, tiny_text = shown or (full, tiny)
        action = self._parser.add_argument(
            flag, type=type, default=None, help=f"{help} (default: {full_text}; {tiny_text} with {self._switch})",
            **kwargs)
        self._defaults[action.dest] = (full, tiny)

    def fill(self, args: argparse.Namespace, tiny: bool) -> argparse.Namespace:
        for dest, (full, small) in self._defaults.items():
            if getattr(args, dest) is None:
                setattr(args, dest, small if tiny else full)
        return args
