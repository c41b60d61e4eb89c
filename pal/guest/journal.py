"""A process's output journal: bounded, with byte offsets that never repeat.

stdout, stderr (or a terminal's one stream) share one offset sequence, so a reader holds
a single number and resumes exactly there after a disconnect, a pause or a move: the
journal lives in guest memory and so travels in every snapshot and fork. When the bound
drops old output, a reader from before it is told how many bytes it lost (a gap), never
handed other bytes in their place.

Not thread-safe by itself: its owner (a :class:`~pal.guest.processes.Process`) guards it.
"""

from __future__ import annotations

from collections import deque

from pal.guest import protocol as P

Record = tuple[int, int, bytes]  # (offset of its first byte, fd, data)


class Journal:
    def __init__(self, capacity: int = P.JOURNAL_DEFAULT_BYTES) -> None:
        self.capacity = capacity
        self.records: deque[Record] = deque()
        self.start = 0  # offset of the oldest byte kept
        self.end = 0  # offset after the newest byte

    def append(self, fd: int, data: bytes) -> None:
        """Add output; past the bound the oldest bytes go (a record may be cut at its head)."""
        if not data:
            return
        self.records.append((self.end, fd, data))
        self.end += len(data)
        excess = self.end - self.start - self.capacity
        while excess > 0 and self.records:
            off, rfd, rdata = self.records[0]
            if len(rdata) <= excess:
                self.records.popleft()
                excess -= len(rdata)
                self.start = off + len(rdata)
            else:
                self.records[0] = (off + excess, rfd, rdata[excess:])
                self.start = off + excess
                excess = 0

    def read(self, offset: int, max_bytes: int) -> tuple[int, list[Record]]:
        """Output from ``offset`` on, at most ``max_bytes`` of it (whole records where they
        fit, the first one always, cut if it alone is larger): ``(gap, records)`` where
        ``gap`` counts the bytes lost to the bound between ``offset`` and the first record.
        """
        gap = max(0, self.start - offset)
        pos = max(offset, self.start)
        out: list[Record] = []
        taken = 0
        for off, fd, data in self.records:
            if off + len(data) <= pos:
                continue
            piece = data[pos - off :] if off < pos else data
            if out and taken + len(piece) > max_bytes:
                break
            piece = piece[: max_bytes - taken] if not out else piece
            out.append((pos if off < pos else off, fd, piece))
            taken += len(piece)
            if taken >= max_bytes:
                break
        return gap, out

    def stats(self) -> dict[str, int]:
        return {"start": self.start, "end": self.end, "capacity": self.capacity}
