"""The one map of the harness's error codes to API errors (pal/manager/guest_errors.py):
file requests and execs read the same table, and a code the host does not know is the
backend's failure (503), never a 500."""

from __future__ import annotations

import pytest

from pal.guest import protocol as p
from pal.wire.guest_errors import to_pal_error

# guest code -> (file status, file code, exec status, exec code); None: the guest's code
TABLE = {
    p.ERR_ESCAPE: (400, "PATH_ESCAPE", 400, "PATH_ESCAPE"),
    p.ERR_NOENT: (404, "FILE_NOT_FOUND", 400, "EXECUTABLE_NOT_FOUND"),
    p.ERR_PERM: (400, None, 400, "NOT_EXECUTABLE"),
    p.ERR_INVAL: (400, None, 400, "INVALID_ARGUMENT"),
    p.ERR_NOTDIR: (400, None, 400, "INVALID_ARGUMENT"),
    p.ERR_ISDIR: (400, None, 400, "INVALID_ARGUMENT"),
    p.ERR_TOOBIG: (413, "PAYLOAD_TOO_LARGE", 413, "PAYLOAD_TOO_LARGE"),
    p.ERR_TIMEOUT: (504, "GUEST_TIMEOUT", 504, "GUEST_TIMEOUT"),
    p.ERR_AUTH: (503, None, 503, None),
    p.ERR_IO: (503, None, 503, None),
    "ESOMETHINGNEW": (503, None, 503, None),
}


@pytest.mark.parametrize("guest_code", sorted(TABLE))
def test_each_guest_code_has_one_status_per_kind_of_request(guest_code: str) -> None:
    file_status, file_code, exec_status, exec_code = TABLE[guest_code]
    for op, status, code in (("file", file_status, file_code), ("exec", exec_status, exec_code)):
        err = to_pal_error(guest_code, "told by the guest", op)  # type: ignore[arg-type]
        assert (err.status, err.code) == (status, code or guest_code), op
        assert err.message == "told by the guest"


def test_an_error_without_a_code_or_message_is_still_said() -> None:
    err = to_pal_error(None, None, "file")
    assert (err.status, err.code) == (503, "GUEST_ERROR") and "GUEST_ERROR" in err.message
