"""A DNS server on loopback for network tests: it answers the names it is given, says
NXDOMAIN for the others (``*.domain`` answers every name directly under it), and never
answers names under its ``silent`` domains (a name server that has gone quiet). Plain UDP
on one thread; dnspython encodes the answers."""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import threading
from collections.abc import Iterator

import dns.message
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset


class LoopbackDns:
    def __init__(
        self, answers: dict[str, str], silent: tuple[str, ...] = (), host: str = "127.0.0.1"
    ) -> None:
        self.answers = {k.lower(): v for k, v in answers.items()}
        self.silent = tuple(s.lower() for s in silent)
        self.queries: list[str] = []  # names asked, in order (each type counts)
        self.unanswered = 0
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((host, 0))
        self.host, self.port = host, self.sock.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._stop = False

    @property
    def nameserver(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> LoopbackDns:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop = True
        with contextlib.suppress(OSError):
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"", (self.host, self.port))
        self._thread.join(5)
        self.sock.close()

    def _serve(self) -> None:
        while not self._stop:
            data, addr = self.sock.recvfrom(4096)
            with contextlib.suppress(Exception):
                reply = self._answer(data)
                if reply is not None:
                    self.sock.sendto(reply, addr)

    def _answer(self, data: bytes) -> bytes | None:
        q = dns.message.from_wire(data)
        question = q.question[0]
        name = question.name.to_text(omit_final_dot=True).lower()
        self.queries.append(name)
        if any(name == s or name.endswith("." + s) for s in self.silent):
            self.unanswered += 1
            return None
        r = dns.message.make_response(q)
        ip = self.answers.get(name)
        if ip is None and "." in name:  # "*.domain" answers every name under it
            ip = self.answers.get("*." + name.split(".", 1)[1])
        if ip is None:
            r.set_rcode(dns.rcode.NXDOMAIN)
        else:
            version = ipaddress.ip_address(ip).version
            rdtype = dns.rdatatype.A if version == 4 else dns.rdatatype.AAAA
            if question.rdtype == rdtype:
                r.answer.append(dns.rrset.from_text(question.name, 30, dns.rdataclass.IN, rdtype, ip))
        return r.to_wire()


@contextlib.contextmanager
def loopback_dns(answers: dict[str, str], silent: tuple[str, ...] = ()) -> Iterator[LoopbackDns]:
    server = LoopbackDns(answers, silent).start()
    try:
        yield server
    finally:
        server.close()
