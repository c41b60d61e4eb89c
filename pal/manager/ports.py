"""The node's side of ports: a byte stream to a server listening inside a guest.

Route (docs/ports.md has the measurements behind it): the node opens a TCP connection from
inside the VM's network namespace to ``GUEST_IP:port``, over the same tap as the guest's
own traffic. That reaches every server bound to 0.0.0.0 with no help from the guest (the
kernel does all the work on both sides). A server bound to 127.0.0.1 refuses that, and then
the node asks the harness's port relay (pal/guest/portrelay.py, on ``GUEST_IP:RELAY_PORT``)
to connect to ``127.0.0.1:port`` for it. Which route worked is remembered per VM and port,
so a loopback-only server pays for the refused attempt once.

The guest is untrusted: the relay's answer is one short line read with a bound and a
deadline; anything else is a 502. The stream itself is the guest's own business.
"""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass

from pal.errors import BadGateway, InvalidRequest
from pal.guest.protocol import GUEST_IP, RELAY_PORT
from pal.network import netns

CONNECT_TIMEOUT_S = 10.0
RELAY_ANSWER_MAX = 64
STREAM_LIMIT = 256 * 1024  # asyncio reader buffer: a slow consumer stops reading the guest


@dataclass
class GuestConnection:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    route: str  # "direct" or "relay"


def check_port(port: int) -> int:
    if not 1 <= port <= 65535:
        raise InvalidRequest(f"port {port} is outside 1-65535")
    return port


def _new_socket() -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setblocking(False)
    return s


async def _connect(ns_name: str, port: int) -> socket.socket:
    """A connected socket from inside the VM's namespace to GUEST_IP:port."""
    # A socket belongs to the namespace it was made in, whichever thread uses it later.
    sock = await asyncio.to_thread(netns.in_namespace, _new_socket, enter=ns_name)
    try:
        await asyncio.wait_for(
            asyncio.get_running_loop().sock_connect(sock, (GUEST_IP, port)), CONNECT_TIMEOUT_S
        )
    except BaseException:
        sock.close()
        raise
    return sock


class PortRoutes:
    """Which route reached each (VM, port) last time."""

    def __init__(self) -> None:
        self._relay: set[tuple[str, int]] = set()

    def forget(self, vm_id: str) -> None:
        self._relay = {k for k in self._relay if k[0] != vm_id}

    async def open(self, vm_id: str, ns_name: str, port: int) -> GuestConnection:
        """A stream to the server on ``port`` in the guest; BadGateway (502) if nothing
        listens there (on 0.0.0.0 or 127.0.0.1) or the guest does not answer."""
        check_port(port)
        key = (vm_id, port)
        relay_first = key in self._relay
        for route in ("relay", "direct") if relay_first else ("direct", "relay"):
            if route == "direct":
                try:
                    sock = await _connect(ns_name, port)
                except ConnectionRefusedError:
                    continue  # maybe a loopback-only server: ask the relay
                except (TimeoutError, OSError) as exc:
                    raise BadGateway(f"port {port} of VM {vm_id} did not answer: {exc}") from None
                self._relay.discard(key)
                return await _stream(sock, "direct")
            conn = await self._via_relay(vm_id, ns_name, port)
            if conn is not None:
                self._relay.add(key)
                return conn
        self._relay.discard(key)
        raise BadGateway(
            f"nothing is listening on port {port} in VM {vm_id} (on 0.0.0.0 or 127.0.0.1)",
            code="PORT_NOT_LISTENING",
        )

    async def _via_relay(self, vm_id: str, ns_name: str, port: int) -> GuestConnection | None:
        """Through the harness's relay; None when nothing listens on 127.0.0.1:port (or the
        image has no relay)."""
        try:
            sock = await _connect(ns_name, RELAY_PORT)
        except ConnectionRefusedError:
            return None
        except (TimeoutError, OSError) as exc:
            raise BadGateway(f"port {port} of VM {vm_id} did not answer: {exc}") from None
        conn = await _stream(sock, "relay")
        try:
            conn.writer.write(f"PORT {port}\n".encode())
            await conn.writer.drain()
            answer = await asyncio.wait_for(conn.reader.readuntil(b"\n"), CONNECT_TIMEOUT_S)
        except (OSError, TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
            conn.writer.close()
            raise BadGateway(f"the port relay of VM {vm_id} did not answer: {exc!r}") from None
        if answer == b"OK\n":
            return conn
        conn.writer.close()
        if answer.startswith(b"ERR ECONNREFUSED"):
            return None
        shown = answer[:RELAY_ANSWER_MAX].decode("ascii", "replace").strip()
        raise BadGateway(f"port {port} of VM {vm_id} could not be reached: {shown}")


async def _stream(sock: socket.socket, route: str) -> GuestConnection:
    reader, writer = await asyncio.open_connection(sock=sock, limit=STREAM_LIMIT)
    return GuestConnection(reader, writer, route)
