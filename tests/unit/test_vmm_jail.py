"""Who a QEMU is and what it may open (pal/vmm/jail.py), and the files around it."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from pal.images import kernel
from pal.vmm import holefilter, jail
from pal.vmm.jail import GROUP_BASE, UID_BASE, Jail

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")


def test_each_vm_its_own_uid_reused_only_after_release() -> None:
    j = Jail(enabled=True)
    a, b = j.identity("a"), j.identity("b")
    assert a == (UID_BASE, UID_BASE) and b == (UID_BASE + 1, UID_BASE + 1)
    assert j.identity("a") == a, "stable while the VM stays"
    j.release("a")
    assert j.identity("c") == a
    assert Jail(enabled=False).identity("x") is None


def test_a_shared_ram_file_belongs_to_its_mappers_group_then_to_root_again(tmp_path: Path) -> None:
    mem, other = tmp_path / "mem", tmp_path / "other-mem"
    for f in (mem, other):
        f.write_bytes(b"")
        f.chmod(0o600)
    j = Jail(enabled=True)
    g1 = j.share(mem, "fork-1")
    assert j.share(mem, "fork-2") == g1, "siblings share one group"
    g2 = j.share(other, "fork-3")
    assert g1 != g2 and g1[0] >= GROUP_BASE, "another snapshot (maybe another tenant's): another group"
    st = mem.stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, g1[0], 0o660)
    j.release("fork-1")
    assert mem.stat().st_gid == g1[0], "still mapped by fork-2"
    j.release("fork-2")
    st = mem.stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, 0, 0o600)
    # an adopted fork finds its group from the file as the last manager left it
    j2 = Jail(enabled=True)
    assert j2.adopt("fork-3", UID_BASE + 7, other) == g2


def test_exec_identity_drops_root_groups_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t")
    kw = jail.exec_kwargs((UID_BASE, UID_BASE), (GROUP_BASE,), "tcg")
    assert kw["user"] == kw["group"] == UID_BASE and kw["extra_groups"] == [GROUP_BASE]
    assert kw["env"] == {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
    out = subprocess.run(
        ["/bin/sh", "-c", "id -u; id -G; env"], capture_output=True, text=True, check=True, **kw
    ).stdout.split("\n")
    assert out[0] == str(UID_BASE) and out[1].split() == [str(UID_BASE), str(GROUP_BASE)]
    assert "s3cr3t" not in "\n".join(out)
    assert jail.exec_kwargs(None, (), "tcg") == {"env": jail.QEMU_ENV}
    # A QEMU mapping its RAM file private (a fork child) gets the hole filter (holefilter.py).
    assert jail.exec_kwargs(None, (), "tcg", private_ram=True)["preexec_fn"] is holefilter.preexec
    assert "preexec_fn" not in jail.exec_kwargs((UID_BASE, UID_BASE), (), "tcg")


def test_kernel_download_dir_is_never_world_writable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, int] = {}

    def fake_run(cmd: list[str], cwd: Path | None = None) -> str:
        assert cwd is not None
        st = cwd.stat()
        seen["mode"] = stat.S_IMODE(st.st_mode)
        (cwd / "linux-image-x_1_amd64.deb").write_bytes(b"deb")
        return ""

    monkeypatch.setattr(kernel, "_run", fake_run)
    cache = tmp_path / "cache"
    deb = kernel.download(kernel.KernelPackage("linux-image-x", "1"), cache)
    assert seen["mode"] == 0o700 and deb.read_bytes() == b"deb" and deb.parent == cache
    assert not list(cache.glob(".*")), "no partial files left"
