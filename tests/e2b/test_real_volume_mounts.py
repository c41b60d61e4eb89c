"""E2B's ``volumeMounts`` through the unmodified E2B Python SDK (e2b 2.45.1) against a real
`pal up` and a real VM (docs/e2b.md, "Volumes"): ``Sandbox.create(volume_mounts=...)``
mounts the tenant's volume (Pal's AgentSpec ``volumes``); a file written by ``Volume``'s
content API is read in the sandbox, one written in the sandbox is read through it; the
sandbox's detail and list show the mount; another tenant's volume name is E2B's 400 (its spec's only
client error for ``POST /sandboxes``; the SDK raises its ``SandboxException``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from e2b import Sandbox, SandboxException, SandboxQuery, Volume

from tests.e2b.conftest import RealE2b, e2b_environ

pytestmark = pytest.mark.vm


@pytest.fixture(autouse=True)
def _env(real_e2b: RealE2b) -> Iterator[None]:
    with e2b_environ(real_e2b):
        yield


def test_a_mounted_volume_is_shared_with_the_volume_content_api(real_e2b: RealE2b) -> None:
    vol = Volume.create("e2b-mounted")
    theirs = Volume.create("e2b-theirs", api_key=real_e2b.other_key)
    try:
        vol.write_file("/f", "from the content API\n")
        # Another tenant's volume, by its name: E2B's answer for a missing volume (400).
        with pytest.raises(SandboxException) as missing:
            Sandbox.create(timeout=300, volume_mounts={"/mnt/y": "e2b-theirs"})
        assert str(missing.value) == "400: volume 'e2b-theirs' not found"

        sbx = Sandbox.create(timeout=300, volume_mounts={"/mnt/x": vol})
        try:
            assert sbx.commands.run("cat /mnt/x/f").stdout == "from the content API\n"
            sbx.commands.run("echo from the sandbox > /mnt/x/g")
            assert vol.read_file("/g") == "from the sandbox\n"

            info = sbx.get_info()
            assert [(m["name"], m["path"]) for m in info.volume_mounts] == [("e2b-mounted", "/mnt/x")]
            listed = [s for s in Sandbox.list(SandboxQuery()).next_items() if s.sandbox_id == sbx.sandbox_id]
            assert [(m["name"], m["path"]) for m in listed[0].volume_mounts] == [("e2b-mounted", "/mnt/x")]
        finally:
            sbx.kill()
    finally:
        Volume.destroy(vol.volume_id)
        Volume.destroy(theirs.volume_id, api_key=real_e2b.other_key)
