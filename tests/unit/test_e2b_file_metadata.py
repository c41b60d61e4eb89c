"""E2B's file metadata and a cell's own variables, without a VM: the rules the host checks
before anything reaches the guest (pal/guest/xattrs.py, the upload's headers, the node
RPC's models), the guest's xattrs on this machine's file system, and bash's cell
variables through the real kernel driver."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from starlette.datastructures import Headers

from pal.e2b.envd_http import metadata_from_headers
from pal.errors import InvalidRequest
from pal.guest import kerneldriver
from pal.guest.errors import ExecError
from pal.guest.workspace import Workspace
from pal.guest.xattrs import FileMetadata, check_metadata, parse_metadata
from pal.wire.code import CodeRun
from pal.wire.file_metadata import FileMetadataList, FileMetadataSet
from pal.wire.models import FileWrite


@pytest.mark.parametrize(
    ("metadata", "why"),
    [
        ({"owner": "ann", "a.b-c_d~1": " ~printable!"}, None),
        ({}, None),
        ({"Owner": "ann"}, "lowercase"),
        ({"": "x"}, "1..246"),
        ({"a b": "x"}, "HTTP header name"),
        ({"k" * 246: "v"}, None),
        ({"k" * 247: "v"}, "1..246"),
        ({"k": "caf\u00e9"}, "printable US-ASCII"),
        ({"k": "tab\there"}, "printable US-ASCII"),
        ({"k": "v" * (4096 - len("user.e2b.k"))}, None),
        ({"k": "v" * (4097 - len("user.e2b.k"))}, "at most 4096"),
        ({f"k{i}": "v" * 90 for i in range(41)}, "at most 4096"),  # the prefix counts per key
        ({"k": 1}, "strings"),
        (["k"], "object"),
    ],
)
def test_metadata_rules(metadata: Any, why: str | None) -> None:
    got = check_metadata(metadata)
    assert (got is None) if why is None else (got is not None and why in got), got


def test_upload_headers_lowercased_first_wins_and_checked() -> None:
    headers = Headers(
        raw=[
            (b"x-metadata-Owner", b"ann"),
            (b"X-Metadata-owner", b"bob"),  # the same key again: the first is kept
            (b"x-metadata-stage", b"draft v2"),
            (b"content-type", b"text/plain"),
        ]
    )
    assert metadata_from_headers(headers) == {"owner": "ann", "stage": "draft v2"}
    assert metadata_from_headers(Headers(raw=[(b"accept", b"*/*")])) == {}
    for bad in [
        (b"x-metadata-" + b"k" * 247, b"v"),
        (b"x-metadata-k", b"v" * 5000),
        (b"x-metadata-k", b"\x01"),
    ]:
        with pytest.raises(InvalidRequest):
            metadata_from_headers(Headers(raw=[bad]))


def test_the_node_rpc_refuses_what_the_guest_would() -> None:
    FileWrite(vm_id="vm-1", path="a", data=b"", metadata=json.dumps({"k": "v"}))
    FileWrite(vm_id="vm-1", path="a", data=b"")  # none: left as it was
    for bad in ["[1]", "{", json.dumps({"K": "v"}), json.dumps({"k": "v" * 5000})]:
        with pytest.raises(ValidationError):
            FileWrite(vm_id="vm-1", path="a", data=b"", metadata=bad)
    with pytest.raises(ValidationError):
        FileMetadataSet(vm_id="vm-1", path="/a", metadata={"k": "\x7f"})
    with pytest.raises(ValidationError):
        FileMetadataSet(vm_id="vm-1", path="relative", metadata={})
    # What a hostile guest answers is held to the same bounds.
    with pytest.raises(ValidationError):
        FileMetadataList.model_validate({"metadata": [{"k": "v" * 5000}]})
    assert parse_metadata('{"a": "b"}') == {"a": "b"}


def test_a_cells_env_is_checked() -> None:
    CodeRun(vm_id="vm-1", code="1", env={"CELL_ONLY": "x"})
    for bad in [{"1X": "x"}, {"A=B": "x"}, {"A": "nul\0"}, {"A": "v" * (65 * 1024)}]:
        with pytest.raises(ValidationError):
            CodeRun(vm_id="vm-1", code="1", env=bad)


def _xattrs_here(path: Path) -> bool:
    try:
        os.setxattr(path, "user.pal-probe", b"1")
    except OSError:
        return False
    return True


def test_guest_xattrs_replaced_by_each_write(tmp_path: Path) -> None:
    probe = tmp_path / "probe"
    probe.touch()
    if not _xattrs_here(probe):
        pytest.skip("this file system keeps no user xattrs")
    ws = Workspace(str(tmp_path), None, None)
    fm = FileMetadata(ws.as_user)
    path = str(tmp_path / "d" / "f.txt")
    ws.write("d/f.txt", b"one", {"owner": "ann", "stage": "draft"})
    os.setxattr(path, "user.other", b"kept")  # not E2B's: neither shown nor removed
    assert fm.get({"paths": [path, str(tmp_path / "none"), str(tmp_path / "d")]}) == {
        "metadata": [{"owner": "ann", "stage": "draft"}, {}, {}]
    }
    ws.write("d/f.txt", b"two", {"stage": "final"})
    assert fm.get({"paths": [path]})["metadata"] == [{"stage": "final"}]
    ws.write("d/f.txt", b"three")  # Pal's own write (no metadata): left as it was
    assert fm.get({"paths": [path]})["metadata"] == [{"stage": "final"}]
    assert fm.set({"path": path, "metadata": {}}) == {"path": path, "metadata": {}}
    assert os.getxattr(path, "user.other") == b"kept"
    with pytest.raises(ExecError):
        fm.set({"path": path, "metadata": {"Bad": "x"}})
    with pytest.raises(ExecError):
        fm.get({"paths": ["relative"]})
    with pytest.raises(ExecError):
        ws.write("d/f.txt", b"x", {"k": "v" * 5000})


def test_bash_cell_env_is_the_cells_alone() -> None:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "SHADOWED": "before"}
    driver = subprocess.Popen(
        [sys.executable, kerneldriver.__file__, "bash"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
    )
    assert driver.stdin is not None and driver.stdout is not None
    try:
        assert json.loads(driver.stdout.readline())["t"] == "ready"

        def cell(code: str, **extra: Any) -> list[str]:
            assert driver.stdin is not None and driver.stdout is not None
            driver.stdin.write(json.dumps({"op": "run", "code": code, **extra}).encode() + b"\n")
            driver.stdin.flush()
            out = []
            while (ev := json.loads(driver.stdout.readline()))["t"] != "done":
                out.append(ev.get("text", ""))
            return out

        quoted = {"CELL_ONLY": "it's $HOME", "SHADOWED": "during", "bad name": "dropped"}
        assert cell("echo $CELL_ONLY $SHADOWED; sh -c 'echo $CELL_ONLY'", env=quoted) == [
            "it's $HOME during\n",
            "it's $HOME\n",
        ]
        assert cell("echo ${CELL_ONLY-unset} $SHADOWED") == ["unset before\n"]
    finally:
        driver.kill()
        driver.wait()
