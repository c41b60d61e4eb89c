"""What an upload body that Pal produces as it goes is to boto3's ``upload_fileobj``: a
read-only, non-seekable raw file object (crypt.EncryptingReader, sparse_object.SparseEncoder);
each says in ``read`` how it makes its bytes."""

from __future__ import annotations

import io


class UploadStream(io.RawIOBase):
    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def read(self, size: int | None = -1) -> bytes:
        raise NotImplementedError

    def readinto(self, b: bytearray | memoryview) -> int:  # type: ignore[override]
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)
