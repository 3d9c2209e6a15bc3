"""Terminal output of the command line and the demo: tables and progress through ``rich``.

One place decides how output looks, so every command prints tables and progress the same way:

* :func:`table` renders rows under a header as a rich table (a header rule, no borders), to a
  string. On a terminal it fits the terminal's width; piped, lines are never wrapped or cut, so
  scripts and ``grep`` see every cell whole.
* :func:`progress` is a byte counter with rate and ETA, :func:`steps` a step counter with a
  status text; both on stderr, shown only on a terminal.
* :func:`printable` escapes what a terminal would interpret. Names and messages come from the
  store, which may be hostile; every cell goes through it and is rendered as plain text (rich
  markup such as ``[bold]`` in a tensor name is printed, never interpreted).
"""

from __future__ import annotations

import io
import os
import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence


def printable(text: str) -> str:
    """``text`` with every non-printable character (ESC, BEL, newline, bidi overrides) escaped as
    Python would write it, so store-supplied text cannot retitle the terminal, move the cursor or
    forge output lines."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def human_bytes(n: float) -> str:
    """``n`` bytes in binary units: ``512 B``, ``1.5 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _width(stream: Any) -> int | None:
    """The terminal's width when ``stream`` is one, else None (no limit)."""
    try:
        if stream.isatty():
            return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        pass
    return None


def table(rows: Sequence[Sequence[Any]], header: Sequence[str], *, title: str | None = None,
          right: Sequence[int] = (), stream: Any = None) -> str:
    """``rows`` under ``header`` as text (no trailing newline). Columns whose index is in
    ``right`` are right-aligned (numbers). Every cell is ``str()``-ed and escaped with
    :func:`printable`."""
    from rich import box
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    width = _width(stream if stream is not None else sys.stdout)
    t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, title=title,
              title_justify="left", header_style="bold")
    for i, name in enumerate(header):
        t.add_column(Text(printable(str(name))), justify="right" if i in right else "left",
                     no_wrap=width is None, overflow="fold")
    for r in rows:
        t.add_row(*(Text(printable(str(c))) for c in r))
    out = io.StringIO()
    console = Console(file=out, width=width or 100_000, force_terminal=width is not None,
                      no_color=width is None, highlight=False, emoji=False, markup=False)
    console.print(t)
    return "\n".join(line.rstrip() for line in out.getvalue().splitlines() if line.strip())


@contextmanager
def progress(description: str, total: int | None) -> Iterator[Callable[[int], None]]:
    """A byte counter on stderr while the block runs (hidden when stderr is not a terminal);
    yields ``advance(n)``. The bar is removed when the block ends."""
    from rich.console import Console
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn,
                               TimeRemainingColumn, TransferSpeedColumn)

    console = Console(file=sys.stderr)
    bar = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True),
                   TransferSpeedColumn(), TimeRemainingColumn(), console=console, transient=True,
                   disable=not console.is_terminal)
    with bar:
        task = bar.add_task(printable(description), total=total)
        yield lambda n: bar.advance(task, n)


@contextmanager
def steps(description: str, total: int, completed: int = 0) -> Iterator[Callable[[int, str], None]]:
    """A step counter (``n/total``, a status text, ETA) on stderr while the block runs (hidden
    when stderr is not a terminal); yields ``advance(n, status)``. It stays on screen at the end."""
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeRemainingColumn)

    console = Console(file=sys.stderr)
    bar = Progress(TextColumn("   {task.description}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.fields[status]}"), TimeRemainingColumn(), console=console,
                   disable=not console.is_terminal)
    with bar:
        task = bar.add_task(printable(description), total=total, completed=completed, status="")
        yield lambda n, status: bar.update(task, advance=n, status=printable(status))
