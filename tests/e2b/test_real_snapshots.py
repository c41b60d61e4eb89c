"""E2B's named snapshots through the unmodified Python SDK against a real `pal up` and real
VMs (Pal's kept snapshots, pal/scheduler/kept.py): a snapshot outlives its sandbox, and the
sandboxes created from it have its files, its running processes and its envs under the
create's own. Three VMs in all, at
most two at once."""

from __future__ import annotations

import pytest
from e2b import Sandbox, SandboxException, SandboxQuery

from tests.e2b.conftest import RealE2b, e2b_environ

# A background process whose state is in its memory: a number it drew, written to a file
# again and again. A sandbox started from the snapshot has the same process, with that number.
WRITER = "n=$RANDOM$RANDOM; echo $n > /tmp/drawn; while :; do echo $n > /tmp/alive; sleep 0.1; done"
# Waits in the guest (a hang guard of 120 s, not a speed bound) until the writer wrote again.
REWRITTEN = (
    "rm -f /tmp/alive; for i in $(seq 1200); do [ -s /tmp/alive ] && break; sleep 0.1; done; cat /tmp/alive"
)


def _sees_the_capture(sbx: Sandbox, drawn: str, writer_pid: int) -> None:
    assert sbx.files.read("kept.txt") == "captured before the snapshot"
    assert sbx.commands.run(REWRITTEN).stdout.strip() == drawn, "the writer runs on with its own number"
    assert writer_pid in [p.pid for p in sbx.commands.list()]
    assert sbx.commands.run("whoami; cat /tmp/drawn").stdout == f"user\n{drawn}\n"


def test_a_named_snapshot_outlives_its_sandbox_and_starts_sandboxes(real_e2b: RealE2b) -> None:
    with e2b_environ(real_e2b):
        src = Sandbox.create(metadata={"suite": "real-snapshots"}, envs={"A": "src", "SRC": "s"}, timeout=900)
        try:
            src.files.write("kept.txt", "captured before the snapshot")
            writer = src.commands.run(WRITER, background=True)
            drawn = src.commands.run(REWRITTEN).stdout.strip()
            assert drawn.isdigit()
            named = src.create_snapshot(name="real-snapshots-1")
            assert named.names == ["real-snapshots-1"] and named.snapshot_id.startswith("snap-")
            unnamed = Sandbox.create_snapshot(src.sandbox_id)
            assert unnamed.names == [] and unnamed.snapshot_id != named.snapshot_id
            assert src.commands.run("cat /tmp/drawn").stdout.strip() == drawn  # the source runs on

            pages = Sandbox.list_snapshots(sandbox_id=src.sandbox_id, limit=1)
            seen = []
            while pages.has_next:
                items = pages.next_items()
                assert len(items) <= 1
                seen += [s.snapshot_id for s in items]
            assert seen == [named.snapshot_id, unnamed.snapshot_id]
            by_name = Sandbox.list_snapshots(name="real-snapshots-1").next_items()
            assert [(s.snapshot_id, s.names) for s in by_name] == [(named.snapshot_id, ["real-snapshots-1"])]
            assert Sandbox.list_snapshots(sandbox_id="nope").next_items() == []
        finally:
            assert src.kill() is True

        # The source is gone; its snapshot is not. Another tenant sees none of it.
        assert Sandbox.list_snapshots(api_key=real_e2b.other_key).next_items() == []
        assert Sandbox.delete_snapshot(named.snapshot_id, api_key=real_e2b.other_key) is False
        with pytest.raises(SandboxException, match="404"):
            Sandbox.create(named.snapshot_id, api_key=real_e2b.other_key)

        first = Sandbox.create(named.snapshot_id, timeout=600, metadata={"run": "first"}, envs={"A": "1"})
        try:
            second = Sandbox.create("real-snapshots-1", timeout=600)
            try:
                assert len({first.sandbox_id, second.sandbox_id, src.sandbox_id}) == 3
                # The create's metadata, not the source's (E2B's sandboxes of a template).
                assert first.get_info().metadata == {"run": "first"}
                assert second.get_info().metadata == {}
                found = Sandbox.list(query=SandboxQuery(metadata={"run": "first"})).next_items()
                assert [s.sandbox_id for s in found] == [first.sandbox_id]
                sources = SandboxQuery(metadata={"suite": "real-snapshots"})
                assert Sandbox.list(query=sources).next_items() == [], "no source tags rode along"
                # The create's envs over the source's (E2B's semantics for a snapshot).
                assert first.commands.run("echo $A $SRC").stdout == "1 s\n"
                assert second.commands.run("echo $A $SRC").stdout == "src s\n", "the source's envs"
                for sbx in (first, second):
                    _sees_the_capture(sbx, drawn, writer.pid)
                first.files.write("kept.txt", "changed in the first")
                assert second.files.read("kept.txt") == "captured before the snapshot"
            finally:
                assert second.kill() is True
        finally:
            assert first.kill() is True

        assert Sandbox.delete_snapshot(named.snapshot_id) is True
        assert Sandbox.delete_snapshot(named.snapshot_id) is False
        for ref in (named.snapshot_id, "real-snapshots-1"):
            with pytest.raises(SandboxException, match="404"):
                Sandbox.create(ref)
        assert Sandbox.delete_snapshot(unnamed.snapshot_id) is True
        assert Sandbox.list_snapshots().next_items() == []
