"""The argument parser of the magics: argparse that raises `UsageError` instead of exiting the kernel."""

from __future__ import annotations

import argparse

from IPython.core.error import UsageError


class MagicArgumentParser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(f"{self.prog}: {message}\n{self.format_usage()}")

    def exit(self, status=0, message=None):  # --help lands here too: show the help as the message
        raise UsageError(message or self.format_help())
