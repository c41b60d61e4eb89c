"""The workload user under E2B's name (pal/guest/usernames.py), on a copy of /etc: the
entries of uid/gid 1000 renamed in passwd, group and their shadows, nothing else touched,
idempotent; and the image's login profile without its `id -u` fork (rootfs.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pal.guest import protocol as P
from pal.guest.errors import ExecError
from pal.guest.usernames import rename_entries, rename_workload_user
from pal.images.rootfs import cheap_login_profile

PASSWD = (
    "root:x:0:0:root:/root:/bin/bash\n"
    "pal:x:1000:1000:Pal workload:/home/pal:/bin/bash\n"
    "bob:x:1001:1001::/home/bob:/bin/sh\n"
)
GROUP = "root:x:0:\nsudo:x:27:pal\npal:x:1000:\nbob:x:1001:\n"
SHADOW = "root:*:19000:0:99999:7:::\npal:!:19000:0:99999:7:::\n"


def _etc(tmp_path: Path) -> Path:
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "passwd").write_text(PASSWD)
    (etc / "group").write_text(GROUP)
    (etc / "shadow").write_text(SHADOW)
    (etc / "shadow").chmod(0o640)
    return etc


def test_uid_1000_becomes_user_with_its_home(tmp_path: Path) -> None:
    etc = _etc(tmp_path)
    assert rename_entries(str(etc), 1000, 1000, "user", "/home/user") is True
    assert (etc / "passwd").read_text() == PASSWD.replace(
        "pal:x:1000:1000:Pal workload:/home/pal:", "user:x:1000:1000:Pal workload:/home/user:"
    )
    assert (etc / "group").read_text() == GROUP.replace("pal:x:1000:", "user:x:1000:")
    assert (etc / "shadow").read_text() == SHADOW.replace("pal:!", "user:!")
    assert (etc / "shadow").stat().st_mode & 0o777 == 0o640  # its mode kept
    assert not (etc / "gshadow").exists()  # a missing file stays missing
    assert rename_entries(str(etc), 1000, 1000, "user", "/home/user") is False  # idempotent


@pytest.mark.parametrize(
    ("name", "home"),
    [("User", "/home/user"), ("a:b", "/home/user"), ("user", "home/user"), ("user", "/home/../etc")],
)
def test_a_bad_name_or_home_is_refused_before_anything_changes(name: str, home: str) -> None:
    with pytest.raises(ExecError) as caught:
        rename_workload_user(1000, 1000, {"name": name, "home": home}, "/workspace")
    assert caught.value.code == P.ERR_INVAL


def test_the_login_profile_asks_bash_not_id(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    profile = tmp_path / "etc/profile"
    profile.write_text('if [ "$(id -u)" -eq 0 ]; then\n  PATH=/sbin\nfi\n')
    cheap_login_profile(tmp_path)
    assert profile.read_text() == 'if [ "${EUID:-$(id -u)}" -eq 0 ]; then\n  PATH=/sbin\nfi\n'
