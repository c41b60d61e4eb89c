"""What the throwaway servers of a local run share (postgres.py, s3.py, and the cluster's
processes in processes.py): a free loopback port, and ``with``: started on entering, stopped
on leaving, whatever happened in between."""

from __future__ import annotations

import socket
from types import TracebackType
from typing import Self


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now (the caller's server takes it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ThrowawayServer:
    def start(self) -> Self:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
