"""How the `pie` commands print their help and their usage errors."""

from __future__ import annotations

import argparse
from typing import NoReturn


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help ends with its default, once: appended as "(default: X)" ("on"/"off" for a
    switch) unless the help already says "(default: ...)", which a flag without a value (None)
    must do in words. Descriptions keep their line breaks. Used by `pie serve`, `pie train` and the
    benchmarks."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "(default" in text or not action.option_strings or action.default in (None, argparse.SUPPRESS):
            return text
        if isinstance(action.default, bool):
            return f"{text} (default: {'on' if action.default else 'off'})"
        return text + " (default: %(default)s)"


class OneLineErrorParser(argparse.ArgumentParser):
    """A usage error is one line naming the flag, and where the flags are listed (argparse would
    print `pie serve`'s 30-line usage above it)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help lists every flag)\n")
