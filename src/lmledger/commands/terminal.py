"""The rich Console the commands print tables on."""

from __future__ import annotations

from rich.console import Console

__all__ = ["console"]


def console(piped_width: int = 160) -> Console:
    """A Console at the terminal's width; piped, `piped_width` columns.

    Piped output has no terminal width to respect: keep the whole table rather than cut it at 80.
    """
    terminal = Console()
    return terminal if terminal.is_terminal else Console(width=piped_width)
