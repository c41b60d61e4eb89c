"""Progress of long work (image builds, template warm-ups, `pal bench` runs) for the person
waiting on it: on a terminal a rich bar with the step, how far and the time spent; in a log
(CI, `install.sh | tee`, a pipe) plain lines instead, one per step and, while a step lasts,
one every ``every_s`` saying that it still runs, so a log never goes quiet for minutes.

    with Steps("image code-interpreter") as steps:
        steps("buildah build", 0.05)      # a step and how far the whole is (0..1)
        steps.log("STEP 3/7: RUN pip install ...")   # a line of a tool's output
"""

from __future__ import annotations

import threading
import time
from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn

EVERY_S = 30.0  # in a log: how often a step that lasts says it still runs


class Steps:
    """A progress reporter: callable as ``(step, fraction)`` (``pal.images``' Progress)."""

    def __init__(self, title: str, console: Console | None = None, every_s: float = EVERY_S) -> None:
        self.title = title
        self.console = console or Console(stderr=True)
        self.every_s = every_s
        self.step, self.fraction = "starting", 0.0
        self._t0 = self._step_t0 = time.monotonic()
        self._bar: Progress | None = None
        self._task: TaskID | None = None
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def live(self) -> bool:
        return self.console.is_terminal

    def __enter__(self) -> Steps:
        if self.live:
            self._bar = Progress(
                SpinnerColumn(),
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                TimeElapsedColumn(),
                console=self.console,
            )
            self._bar.__enter__()
            self._task = self._bar.add_task(self.title, total=1.0)
        else:
            self._ticker = threading.Thread(target=self._tick, name="progress", daemon=True)
            self._ticker.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        if self._bar is not None:
            self._bar.__exit__(None, None, None)
        elif kind is None:
            self._line(f"done in {time.monotonic() - self._t0:.0f} s")

    def __call__(self, step: str, fraction: float) -> None:
        fraction = max(0.0, min(1.0, fraction))
        with self._lock:
            new = step != self.step
            self.step, self.fraction = step, fraction
            if new:
                self._step_t0 = time.monotonic()
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, description=f"{self.title}: {step}", completed=fraction)
        elif new:
            self._line(f"{step} ({fraction:.0%})")

    def log(self, line: str) -> None:
        """A line of a tool's output: above the bar on a terminal, as it is in a log."""
        self.console.print(line, markup=False, highlight=False, soft_wrap=True)

    def _line(self, what: str) -> None:
        self.console.print(f"{self.title}: {what}", markup=False, highlight=False, soft_wrap=True)

    def _tick(self) -> None:
        while not self._stop.wait(self.every_s):
            with self._lock:
                step, since = self.step, time.monotonic() - self._step_t0
            self._line(f"still {step} ({since:.0f} s; {time.monotonic() - self._t0:.0f} s in all)")
