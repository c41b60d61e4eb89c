"""One code context's driver: a child of the harness, speaking JSON lines (kernels.py).

Run as ``python3 kerneldriver.py python|bash`` by the harness, as the workload user, in
the context's cwd and env. Standalone on purpose (stdlib only at import): the ``python``
language runs under the *image's* python3, which has Jupyter (the code-interpreter
image), while the harness runs Pal's own interpreter, which never sees the image's
site-packages; ``bash`` runs under Pal's interpreter and needs only ``bash``.

- python: Jupyter's ipykernel started and driven by jupyter_client (imported only here,
  at start: an image without it answers ``fail``), over IPC sockets in a private
  directory (no TCP: a restored guest resets TCP connections the snapshot froze).
- bash: one persistent ``bash`` per context; a cell is ``source``d from a file, so its
  variables, functions and cwd persist; SIGINT is trapped to ``return`` from the cell.

Requests on stdin: ``{"op": "run", "code", "env"?}`` (``env``: set for that cell only),
``{"op": "interrupt"}`` and ``{"op": "rekey", "set", "unset", "hostname", "reseed"}`` (the
VM took a new identity: a restore, a fork, a claim from the warm pool; the kernel's
environment follows it and, when it is another VM's, Python's ``random`` is reseeded, as
after an ``os.fork``; it answers nothing).
Runs and rekeys are done in order, one at a time, on a worker thread: an interrupt is read
while a cell runs. Events on the protocol fd: ``ready {kernel_pid}`` | ``fail {msg}`` once,
then per cell ``stream {name, text}``, ``result {data, main}``, ``error {name, value,
traceback}``, ``done {count}``.
The kernel's own stdout/stderr go to /dev/null: only this driver writes the protocol fd.
"""

from __future__ import annotations

import json
import os
import queue
import re
import secrets
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

MIMES = ("text/plain", "text/html", "image/png", "image/svg+xml", "application/json")
CHUNK = 64 * 1024  # a bash cell's output goes out in lines of at most this
READY_TIMEOUT_S = 170.0  # a kernel not ready by then failed (TCG, a loaded host; kernels.py waits 180 s)
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")  # what a rekey may set or unset


def rekey_env(req: dict[str, Any]) -> tuple[dict[str, str], list[str]]:
    """A rekey's variables to set and unset, only well-formed names and string values."""
    raw_set, raw_unset = req.get("set"), req.get("unset")
    sets = raw_set if isinstance(raw_set, dict) else {}
    unsets = raw_unset if isinstance(raw_unset, list) else []
    ok = {k: v for k, v in sets.items() if isinstance(k, str) and ENV_NAME.match(k) and isinstance(v, str)}
    return ok, [k for k in unsets if isinstance(k, str) and ENV_NAME.match(k) and k not in ok]


def cell_env(req: dict[str, Any]) -> dict[str, str]:
    """A run's own variables (set for that cell only), only well-formed ones."""
    raw = req.get("env")
    env = raw if isinstance(raw, dict) else {}
    return {k: v for k, v in env.items() if isinstance(k, str) and ENV_NAME.match(k) and isinstance(v, str)}


class Out:
    """The protocol stream: one JSON object per line, written whole under a lock."""

    def __init__(self, fd: int) -> None:
        self.f = os.fdopen(fd, "wb", buffering=0)
        self.lock = threading.Lock()

    def emit(self, t: str, **fields: Any) -> None:
        line = json.dumps({"t": t, **fields}, separators=(",", ":")).encode() + b"\n"
        with self.lock:
            self.f.write(line)


class Wire:
    """The kernel's shell and IOPub sockets, driven directly (plain blocking ZeroMQ): a
    request is signed by jupyter_client's Session, a message read is only JSON-decoded as
    far as needed. jupyter_client's own blocking client runs an asyncio loop per message
    and parses every header's dates; under TCG that doubled a trivial cell's time in the
    kernel (docs/benchmarks/code.md). Incoming messages are not HMAC-checked: the sockets
    are IPC files in a 0700 directory of this user, whose kernel runs the user's code."""

    DELIM = b"<IDS|MSG>"

    def __init__(self, info: dict[str, Any]) -> None:
        import zmq
        from jupyter_client.session import Session

        self.zmq = zmq
        key = info["key"] if isinstance(info["key"], bytes) else str(info["key"]).encode()
        self.session = Session(key=key, signature_scheme=info["signature_scheme"])
        ctx = zmq.Context.instance()
        base = f"ipc://{info['ip']}-"
        self.shell = ctx.socket(zmq.DEALER)
        self.shell.linger = 0
        self.shell.connect(base + str(info["shell_port"]))
        self.iopub = ctx.socket(zmq.SUB)
        self.iopub.linger = 0
        self.iopub.setsockopt(zmq.SUBSCRIBE, b"")
        self.iopub.connect(base + str(info["iopub_port"]))

    def request(self, msg_type: str, content: dict[str, Any]) -> str:
        msg = self.session.msg(msg_type, content)
        self.session.send(self.shell, msg)
        while self.shell.poll(0):  # replies are not needed: IOPub's idle ends a request
            self.shell.recv_multipart()
        return str(msg["header"]["msg_id"])

    def next_of(self, msg_id: str, timeout_ms: int | None = None) -> tuple[str, dict[str, Any]] | None:
        """The next IOPub message answering ``msg_id``: (type, content); None on timeout."""
        while True:
            if timeout_ms is not None and not self.iopub.poll(timeout_ms):
                return None
            frames = self.iopub.recv_multipart()
            try:
                at = frames.index(self.DELIM)
                parent = json.loads(frames[at + 3])
                if not isinstance(parent, dict) or parent.get("msg_id") != msg_id:
                    continue
                kind = json.loads(frames[at + 2])["msg_type"]
                content = json.loads(frames[at + 5])
            except (ValueError, IndexError, KeyError, TypeError):
                continue
            if isinstance(content, dict):
                return str(kind), content

    def wait_idle(self, msg_id: str) -> None:
        while True:
            got = self.next_of(msg_id)
            if got and got[0] == "status" and got[1].get("execution_state") == "idle":
                return

    def wait_ready(self, timeout: float) -> None:
        """Until the kernel answers a kernel_info request on IOPub: then it runs, and this
        subscription is live (a SUB socket misses what is published before it joins)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            msg_id = self.request("kernel_info_request", {})
            if self.next_of(msg_id, 1000) is not None:
                self.wait_idle(msg_id)
                return
        raise TimeoutError(f"the kernel did not answer in {timeout:.0f} s")


class PythonKernel:
    def __init__(self, out: Out) -> None:
        from jupyter_client.manager import KernelManager  # the image's; absent: ``fail``

        self.out = out
        self.dir = tempfile.mkdtemp(prefix="pal-kernel-")
        os.environ["JUPYTER_RUNTIME_DIR"] = self.dir
        self.km = KernelManager(transport="ipc", ip=os.path.join(self.dir, "k"))
        # independent: no JPY_PARENT_PID, so the kernel runs no parent poller waking every
        # second; no heartbeat channel either (a thread pinging every second): an idle
        # kernel holds no timer, and the VM's idle probe can see it idle and suspend it.
        null = subprocess.DEVNULL
        self.km.start_kernel(stdout=null, stderr=null, stdin=null, independent=True)
        self.wire = Wire(self.km.get_connection_info())
        self.wire.wait_ready(READY_TIMEOUT_S)
        prov = getattr(self.km, "provisioner", None)
        self.pid = int(getattr(prov, "pid", 0) or getattr(getattr(self.km, "kernel", None), "pid", 0) or 0)

    def execute(self, code: str, silent: bool) -> str:
        content = {"code": code, "silent": silent, "store_history": not silent, "user_expressions": {}}
        # One cell at a time: nothing queued for an error to abort (stop_on_error would abort
        # a cell sent right after an error or an interrupt, while the kernel still aborts).
        return self.wire.request("execute_request", {**content, "allow_stdin": False, "stop_on_error": False})

    def rekey(self, req: dict[str, Any]) -> None:
        """Silently (no count, no history, no output): the new environment and, if asked, a
        new seed for ``random``; an expression, so the user's namespace gets no name."""
        sets, unsets = rekey_env(req)
        code = (
            f"(lambda os, sys: (os.environ.update({sets!r}),"
            f" [os.environ.pop(k, None) for k in {unsets!r}],"
            f" {req.get('reseed') is True} and 'random' in sys.modules and sys.modules['random'].seed()))"
            "(__import__('os'), __import__('sys'))"
        )
        self.wire.wait_idle(self.execute(code, silent=True))

    def run(self, code: str, env: dict[str, str]) -> None:
        """A cell; with ``env``, those variables set in ``os.environ`` before it and put
        back as they were after it (E2B's interpreter does the same), silently."""
        if env:
            keys = list(env)
            self.wire.wait_idle(
                self.execute(
                    f"(lambda os: (setattr(os, '_pal_cell_env', {{k: os.environ.get(k) for k in {keys!r}}}),"
                    f" os.environ.update({env!r})))(__import__('os'))",
                    silent=True,
                )
            )
        try:
            count = self._cell(code)
        finally:
            if env:
                self.wire.wait_idle(
                    self.execute(
                        "(lambda os: [os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)"
                        " for k, v in os.__dict__.pop('_pal_cell_env', {}).items()])(__import__('os'))",
                        silent=True,
                    )
                )
        self.out.emit("done", count=count)

    def _cell(self, code: str) -> Any:
        msg_id = self.execute(code, silent=False)
        count = None
        while True:
            got = self.wire.next_of(msg_id)
            if got is None:
                continue
            kind, content = got
            if kind == "stream":
                self.out.emit("stream", name=content.get("name"), text=content.get("text", ""))
            elif kind in ("display_data", "update_display_data", "execute_result"):
                data = {k: v for k, v in content.get("data", {}).items() if k in MIMES}
                if "application/json" in data:
                    data["application/json"] = json.dumps(data["application/json"])
                self.out.emit("result", data=data, main=kind == "execute_result")
            elif kind == "error":
                tb = [str(x) for x in content.get("traceback", [])]
                self.out.emit("error", name=content.get("ename"), value=content.get("evalue"), traceback=tb)
            elif kind == "execute_input":
                count = content.get("execution_count")
            elif kind == "status" and content.get("execution_state") == "idle":
                break
        return count

    def interrupt(self) -> None:
        if self.pid:
            os.kill(self.pid, signal.SIGINT)


class BashKernel:
    def __init__(self, out: Out) -> None:
        self.out = out
        self.dir = tempfile.mkdtemp(prefix="pal-bash-")
        self.marker = "__PAL_CELL_END_" + secrets.token_hex(8)
        self.count = 0
        self.proc = subprocess.Popen(
            ["bash", "--noprofile", "--norc"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # SIGINT to its group reaches the cell's commands
        )
        self.pid = self.proc.pid
        self._send('trap "return 130 2>/dev/null" INT\n')

    def _send(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text.encode())
        self.proc.stdin.flush()

    def _pump(self, f: Any, name: str, codes: list[int]) -> None:
        mark = self.marker.encode()
        carry = b""  # a cut line's tail that may be the start of the marker
        for piece in iter(lambda: f.readline(CHUNK), b""):
            line, carry = carry + piece, b""
            at = line.find(mark)
            if at >= 0:  # the cell's last line may lack its newline: the marker follows it
                if at:
                    self.out.emit("stream", name=name, text=line[:at].decode("utf-8", "replace"))
                tail = line[at + len(mark) :].strip()
                if tail.lstrip(b"-").isdigit():
                    codes.append(int(tail))
                return
            if not line.endswith(b"\n"):
                line, carry = line[: -len(mark)], line[-len(mark) :]
            if line:
                self.out.emit("stream", name=name, text=line.decode("utf-8", "replace"))

    def run(self, code: str, env: dict[str, str]) -> None:
        """A cell, ``source``d; with ``env``, those variables exported for it and put back
        as they were (or unset) after it."""
        self.count += 1
        pre = "".join(
            f"__pal_had_{k}=${{{k}+1}}; __pal_old_{k}=${{{k}-}}; export {k}={shlex.quote(v)}; "
            for k, v in env.items()
        )
        post = "".join(
            f'if [ -n "$__pal_had_{k}" ]; then export {k}="$__pal_old_{k}"; else unset {k}; fi; '
            f"unset __pal_had_{k} __pal_old_{k}; "
            for k in env
        )
        path = os.path.join(self.dir, "cell.sh")
        with open(path, "w", encoding="utf-8") as f:
            f.write(code + "\n")
        codes: list[int] = []
        pumps = [
            threading.Thread(target=self._pump, args=(self.proc.stdout, "stdout", codes)),
            threading.Thread(target=self._pump, args=(self.proc.stderr, "stderr", [])),
        ]
        for t in pumps:
            t.start()
        self._send(
            f"{pre}source {path} </dev/null; __pal_rc=$?; {post}printf '%s%d\\n' {self.marker} $__pal_rc; "
            f"printf '%s\\n' {self.marker} >&2\n"
        )
        for t in pumps:
            t.join()
        rc = codes[0] if codes else -1
        if rc != 0:
            self.out.emit("error", name="ExitStatus", value=str(rc), traceback=[f"exit status {rc}"])
        self.out.emit("done", count=self.count)

    def rekey(self, req: dict[str, Any]) -> None:
        """The new environment, exported in the shell between cells; and bash's own
        HOSTNAME (set once, at its start)."""
        sets, unsets = rekey_env(req)
        lines = [f"export {k}={shlex.quote(v)}" for k, v in sets.items()]
        lines += [f"unset {k}" for k in unsets]
        host = req.get("hostname")
        if isinstance(host, str) and host:
            lines.append(f"HOSTNAME={shlex.quote(host)}")
        if lines:
            self._send("\n".join(lines) + "\n")

    def interrupt(self) -> None:
        os.killpg(self.pid, signal.SIGINT)


def main() -> int:
    lang = sys.argv[1] if len(sys.argv) > 1 else "python"
    proto = os.dup(1)  # the protocol's fd; 1 and 2 go nowhere (a kernel writing them is noise)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 1)
    os.dup2(null, 2)
    out = Out(proto)
    try:
        kernel: PythonKernel | BashKernel = PythonKernel(out) if lang == "python" else BashKernel(out)
    except ImportError as exc:
        out.emit("fail", msg=f"no Jupyter kernel support in this image ({exc.name or exc})")
        return 3
    except Exception as exc:
        out.emit("fail", msg=f"the {lang} kernel did not start: {exc!r}"[:1000])
        return 4
    out.emit("ready", kernel_pid=kernel.pid)
    jobs: queue.Queue[tuple[Any, Any]] = queue.Queue()
    threading.Thread(target=_work, args=(jobs,), daemon=True).start()
    for raw in sys.stdin.buffer:
        try:
            req = json.loads(raw)
        except ValueError:
            continue
        if not isinstance(req, dict):
            continue
        if req.get("op") == "interrupt":
            try:
                kernel.interrupt()
            except OSError:
                pass
        elif req.get("op") == "run" and isinstance(req.get("code"), str):
            jobs.put((_runner(kernel), req))  # the harness sends one cell at a time
        elif req.get("op") == "rekey":
            jobs.put((kernel.rekey, req))
    return 0


def _runner(kernel: PythonKernel | BashKernel) -> Any:
    return lambda req: kernel.run(req["code"], cell_env(req))


def _work(jobs: queue.Queue[tuple[Any, Any]]) -> None:
    """Runs and rekeys in order, one at a time (a kernel client is not thread-safe)."""
    while True:
        fn, arg = jobs.get()
        try:
            fn(arg)
        except Exception:  # as a cell's thread did: no ``done``, the harness's timeout acts
            pass


if __name__ == "__main__":
    sys.exit(main())
