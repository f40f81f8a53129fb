"""Command-line parsing every ``layerlift bench NAME`` shares: one-line errors
and value types that name what they accept.

:class:`BenchParser` is an ``argparse.ArgumentParser`` whose errors are one
line on stderr, ``PROG: error: argument --OPTION: what was wrong and what is
accepted``, with exit status 2 (argparse's own convention for usage errors),
and whose ``--help`` shows ``(default: X)`` only where X is the real default
(not for flags, not where the default is chosen later: those options state
their default in their own help). The type functions below raise
``argparse.ArgumentTypeError`` with the accepted forms, which argparse
prefixes with the option's name.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Iterable
from typing import NoReturn

__all__ = ["BenchParser", "device", "float_above", "int_at_least", "int_list", "name_list"]

_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")


class _Help(argparse.HelpFormatter):
    """Appends ``(default: X)`` where X is a real default: not None, not a
    flag's False, and not already named in the option's help."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (action.default is None or action.default is argparse.SUPPRESS
                or isinstance(action.default, bool) or "default" in text
                or not action.option_strings):
            return text
        shown = (",".join(map(str, action.default)) if isinstance(action.default, list | tuple)
                 else "%(default)s")
        return f"{text} (default: {shown})"


class BenchParser(argparse.ArgumentParser):
    """An ArgumentParser with one-line errors (exit status 2) and true defaults in --help."""

    def __init__(self, prog: str, description: str | None = None,
                 raw_description: bool = False) -> None:
        formatter: type[argparse.HelpFormatter] = _Help
        if raw_description:
            class _RawHelp(argparse.RawDescriptionHelpFormatter, _Help):
                pass
            formatter = _RawHelp
        super().__init__(prog=prog, description=description, formatter_class=formatter)

    def error(self, message: str) -> NoReturn:
        """Print ``PROG: error: MESSAGE`` as one line on stderr and exit with status 2."""
        line = " ".join(message.split())
        self.exit(2, f"{self.prog}: error: {line} (see {self.prog} --help)\n")


def int_at_least(least: int) -> Callable[[str], int]:
    """An integer >= ``least``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = least - 1
        if value < least:
            raise argparse.ArgumentTypeError(f"expected an integer >= {least}, got {text!r}")
        return value

    parse.__name__ = f"integer >= {least}"
    return parse


def float_above(low: float) -> Callable[[str], float]:
    """A number > ``low``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = low
        if not value > low or value != value:
            raise argparse.ArgumentTypeError(f"expected a number > {low:g}, got {text!r}")
        return value

    parse.__name__ = f"number > {low:g}"
    return parse


def int_list(least: int, example: str) -> Callable[[str], list[int]]:
    """Comma-separated integers, each >= ``least`` (at least one)."""

    def parse(text: str) -> list[int]:
        parts = [x for x in text.replace(" ", "").split(",") if x]
        try:
            values = [int(x) for x in parts]
        except ValueError:
            values = []
        if not values or min(values) < least:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated integers >= {least} (e.g. {example}), got {text!r}")
        return values

    parse.__name__ = "integer list"
    return parse


def name_list(choices: Iterable[str], also: str = "",
              allow: Callable[[str], bool] | None = None) -> Callable[[str], list[str]]:
    """Comma-separated names, each one of ``choices`` (or accepted by ``allow``,
    described as ``also`` in the message)."""
    names = list(choices)

    def parse(text: str) -> list[str]:
        parts = [x for x in text.replace(" ", "").split(",") if x]
        bad = [x for x in parts if x not in names and not (allow is not None and allow(x))]
        if not parts or bad:
            raise argparse.ArgumentTypeError(
                f"unknown name {(bad or [text])[0]!r}; choose from {', '.join(names)}{also} "
                "(comma-separated)")
        return parts

    parse.__name__ = "name list"
    return parse


def device(text: str) -> str:
    """``cpu`` or ``cuda[:N]``; a CUDA device must exist on this machine."""
    if not _DEVICE.match(text):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    if text.startswith("cuda"):
        import torch

        index = int(text.partition(":")[2] or 0)
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(
                f"{text!r} needs CUDA, and this machine's torch sees no CUDA device; use cpu")
        if index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(
                f"{text!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return text
