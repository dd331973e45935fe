"""Progress bars for the long commands: training steps, benchmark phases, simulator runs.

A bar is drawn on stderr only when it is a terminal (rich decides: `TTY_COMPATIBLE=1` or
`FORCE_COLOR` force it); piped, in CI or under pytest the commands print their usual lines and
nothing else. Bars nest: a bar opened while another is shown (`rose bench train` runs a
training loop per phase) becomes a second line of the same display, removed when it ends,
since rich allows one live display per process.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

_shown: Progress | None = None  # the display every open bar of this process is a line of


class Bar:
    """One line of the display: `advance()` as each unit ends, `describe()` as the next starts."""

    def __init__(self, progress: Progress | None = None, task: TaskID | None = None,
                 description: str = "") -> None:
        self.progress, self.task, self.description = progress, task, description

    def describe(self, what: str) -> None:
        if self.progress is not None and self.task is not None:
            self.progress.update(self.task, description=f"{self.description}: {what}")

    def advance(self) -> None:
        if self.progress is not None and self.task is not None:
            self.progress.advance(self.task)


@contextmanager
def bar(description: str, total: int) -> Iterator[Bar]:
    """A progress bar of `total` units headed `description`, for the `with` block's length."""
    global _shown
    console = Console(stderr=True)
    if not console.is_terminal:
        yield Bar()
        return
    owner, progress = _shown is None, _shown
    if progress is None:
        progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), console=console)
        progress.start()
        _shown = progress
    task = progress.add_task(description, total=total)
    try:
        yield Bar(progress, task, description)
    finally:
        if owner:
            progress.stop()  # the finished bar stays on the terminal
            _shown = None
        else:
            progress.remove_task(task)
