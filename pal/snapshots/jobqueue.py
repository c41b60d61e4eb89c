"""A persistent, retrying job queue run by one background thread.

Used for the S3 mirror: a job is a small JSON file in the queue dir, written (fsynced)
before ``submit`` returns and removed only after the job succeeded, so a crash or restart
retries whatever was pending. One worker runs jobs in submission order; a failed job is
retried with exponential backoff while later jobs go ahead. Jobs must be idempotent.

A job can be submitted *held*: persisted now, run only after ``release`` (or dropped with
``discard``). A caller that must record its intent before an action (the seal job before a
snapshot's publishing rename) uses it so the worker never runs ahead of the action; a
restart loads held jobs as ordinary ones, and their handlers judge what was done.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pal.snapshots.local import fsync_path, write_json_durably


class DropJob(Exception):
    """Raised by a handler when a job can never succeed (its input is gone): no retry."""


@dataclass(eq=False)
class Job:
    path: Path
    data: dict[str, Any]
    attempts: int = 0
    not_before: float = 0.0
    held: bool = False


Handler = Callable[[dict[str, Any]], None]


class JobQueue:
    def __init__(
        self,
        queue_dir: Path,
        handler: Handler,
        log: logging.Logger,
        *,
        retry_base_s: float = 1.0,
        retry_max_s: float = 60.0,
        name: str = "pal-jobs",
    ) -> None:
        self.dir = queue_dir
        self.dir.mkdir(parents=True, exist_ok=True)
        self._handler = handler
        self._log = log
        self._retry_base_s = retry_base_s
        self._retry_max_s = retry_max_s
        self._name = name
        self._cond = threading.Condition()
        self._jobs: list[Job] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._seq = 0
        self._load()

    def _load(self) -> None:
        """Pick up the jobs a previous process left pending (oldest first)."""
        for path in sorted(self.dir.glob("*.json")):
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                self._log.warning("dropping unreadable queued job %s", path)
                path.unlink(missing_ok=True)
                continue
            self._jobs.append(Job(path, data))
            self._seq = max(self._seq, int(path.name.split("-", 1)[0]) + 1)
        if self._jobs:
            self._log.info("%s: %d pending job(s) from a previous run", self._name, len(self._jobs))

    def start(self) -> None:
        with self._cond:
            if self._thread is not None:
                return
            self._stopping = False
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the worker after its current job; pending jobs stay on disk."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout)

    def submit(self, data: dict[str, Any], *, held: bool = False) -> Job:
        """Persist a job and queue it; a ``held`` one waits for ``release``."""
        with self._cond:
            seq = self._seq
            self._seq += 1
        # Sequence in the name keeps submission order across restarts.
        path = self.dir / f"{seq:020d}-{uuid.uuid4().hex[:8]}.json"
        write_json_durably(path, data)
        fsync_path(self.dir)
        job = Job(path, data, held=held)
        with self._cond:
            self._jobs.append(job)
            self._cond.notify_all()
        return job

    def release(self, job: Job) -> None:
        with self._cond:
            job.held = False
            self._cond.notify_all()

    def discard(self, job: Job) -> None:
        """Forget a held job (its action did not happen)."""
        self._finish(job)

    def pending(self) -> int:
        with self._cond:
            return len(self._jobs)

    def flush(self, timeout: float) -> bool:
        """Retry waiting jobs now and wait until the queue is empty. False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            for job in self._jobs:
                job.not_before = 0.0
            self._cond.notify_all()
            while self._jobs:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def _next_job(self) -> Job | None:
        """Wait for a runnable job (called with the condition held)."""
        while not self._stopping:
            now = time.monotonic()
            ready = [j for j in self._jobs if not j.held and j.not_before <= now]
            if ready:
                return ready[0]
            wake = min((j.not_before for j in self._jobs if not j.held), default=None)
            self._cond.wait(None if wake is None else max(0.0, wake - now))
        return None

    def _run(self) -> None:
        # Background work (sealing checksums, S3 transfers) must not take CPU from the
        # guests: on Linux a thread has its own nice value, so lower only this one.
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        while True:
            with self._cond:
                job = self._next_job()
                if job is None:
                    return
            try:
                self._handler(job.data)
            except DropJob as exc:
                self._log.warning("%s: dropping job %s: %s", self._name, job.data.get("op"), exc)
                self._finish(job)
            except Exception as exc:
                # Any failure (network, server, credentials) is retried: the local copy
                # is safe, so the mirror only has to catch up eventually.
                job.attempts += 1
                delay = min(self._retry_max_s, self._retry_base_s * 2 ** (job.attempts - 1))
                self._log.warning(
                    "%s: job %s failed (attempt %d), retrying in %.1fs: %s",
                    self._name,
                    job.data.get("op"),
                    job.attempts,
                    delay,
                    exc,
                )
                with self._cond:
                    job.not_before = time.monotonic() + delay
            else:
                self._finish(job)

    def _finish(self, job: Job) -> None:
        job.path.unlink(missing_ok=True)
        with self._cond:
            if job in self._jobs:
                self._jobs.remove(job)
            self._cond.notify_all()
