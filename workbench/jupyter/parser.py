"""The argument parser of the magics: argparse that raises `UsageError` instead of exiting the kernel."""

from __future__ import annotations

import argparse

from IPython.core.error import UsageError


class _HelpShown(Exception):
    pass


class MagicArgumentParser(argparse.ArgumentParser):
    """`parse_args` returns None after `--help` (argparse printed the help once; the magic then
    does nothing), and bad arguments raise `UsageError` naming what is wrong."""

    def parse_args(self, args=None, namespace=None):
        try:
            return super().parse_args(args, namespace)
        except _HelpShown:
            return None

    def error(self, message):
        raise UsageError(f"{self.prog}: {message}\n{self.format_usage()}")

    def exit(self, status=0, message=None):
        if status == 0 and message is None:  # --help, already printed
            raise _HelpShown
        raise UsageError(message or self.format_help())
