"""Host <-> guest harness wire protocol. Shared by the harness (inside the VM) and the manager.

Stdlib only: this file is copied into the guest image next to the harness.

Framing: one message per line, UTF-8 JSON, terminated by ``\\n``. Binary payloads travel
base64-encoded in the ``data`` field. Line framing is chosen on purpose: the channel is a
virtio-serial byte stream that is cut and re-joined across snapshot/restore, so a reader
must be able to resynchronise; it just drops any line that does not parse. Each side
writes a bare ``\\n`` when it (re)connects so a half-written line is terminated.

Multiplexing: every request carries an ``id`` chosen by the host (positive int, unique per
connection); every reply and stream chunk echoes it. ``id`` 0 is reserved for unsolicited
guest messages (heartbeats).

Host -> guest kinds (``k``):
  identify  {incarnation:int, token:str, vm_id:str, now_ns:int, seed:hex, env:{}, mac:str,
            ca_pem:str, own:bool}
            Takes a new identity (after boot, restore, fork): sets the wall clock, reseeds
            the RNG, replaces the exec token, sets the NIC's MAC, and resets every TCP
            connection a snapshot froze open (the host side of them is gone). ``own``: the
            identity is a tenant's VM's (not a template's or a pooled VM's): only then, after
            the reseed, does the harness read the kernel's boot_id, which the kernel draws
            at its first read, so that no snapshot a template or pool restores from has
            drawn it. A non-empty
            ``ca_pem`` (a VM with brokered secrets) is added to the system trust store and
            named by SSL_CERT_FILE, REQUESTS_CA_BUNDLE, NODE_EXTRA_CA_CERTS in every exec.
            Replies ``ok`` {vm_id, incarnation, steps_us, wall_ns} (``wall_ns``: the
            guest's wall clock as it answers, for the host's clock correction), then sends
            a heartbeat at once.
  exec      {tok, argv:[executable, args...], env:{}, cwd:str|None, timeout:float|None,
            user:str|None}  -> ``started`` {pid}, ``out`` chunks, then ``exit`` or ``err``.
            The command is a process (below): a host that loses the stream reads the rest
            with ``pread``/``pattach`` by that pid.
  cancel    {target:int}  kill the exec whose request id is ``target`` (an attach stream
            is only detached).
  detach    {target:int, reason:str?}  end the exec or attach stream ``target`` without
            touching its process: the stream ends with ``ok`` {detached: true, reason}
            (``reason``: the host's, e.g. ``slow-reader``, else ``detached``).
  credit    {target:int, n:int}  flow control: the host has taken ``n`` more bytes of stream
            ``target``'s replies (no answer).

  Flow control (credits). A stream request (``exec``, ``pattach``, ``crun``) may carry
  ``window:int``: the wire bytes (whole lines) of its ``out``, ``gap`` and ``cev`` replies
  the guest may send ahead of the host's reader. The guest sends one such reply only while
  its credit is above zero (it may overshoot by that one line) and waits otherwise; each
  ``credit`` message adds ``n``. The stream's first and last replies (``started``,
  ``exit``, ``err``, ``ok``) and everything outside streams (heartbeats, single answers) are
  never held back. So one stream whose reader is slow holds only its own sender, never the
  channel: the host reads on, and heartbeats and other requests' answers get through.

  Processes (every command is one; ``pid`` is the harness's own id, stable across
  snapshots and forks; output is one journal of byte offsets shared by fd 1 and 2):
  pstart    {tok, argv, env, cwd, user, timeout, stdin:bool, pty:{cols,rows}|null, tag:str,
            keep_awake:bool, journal_bytes:int} -> ok {process}
  plist     {tok}                  -> ok {processes:[process...]}
  pget      {tok, pid}             -> ok {process}
  pread     {tok, pid, from:int, max_bytes:int, wait_ms:int} -> ok {process, from, next,
            gap, records:[{fd, o, n}]} + data (the records' bytes, in order; ``gap``: bytes
            lost to the journal's bound before ``from``'s first kept byte)
  pattach   {tok, pid, from:int}   -> ``gap`` {n}?, ``out`` {fd, o} chunks (``o``: the offset
            after the chunk), then ``exit`` {code, timed_out} once the output is complete,
            or ``ok`` {detached: true} on cancel/detach
  pstdin    {tok, pid, eof:bool} + data -> ok {written:int} (fewer than sent: the process
            read nothing for a while; send the rest again)
  psignal   {tok, pid, signal:"INT"|...} -> ok {}   (to the process group)
  presize   {tok, pid, cols, rows} -> ok {}
  pwait     {tok, pid, timeout_ms} -> ok {process}  (once it exited and its output is all in
            the journal, or at the timeout)
  pdelete   {tok, pid}             -> ok {pid, deleted:true}  (killed first if running)
  process   {pid, os_pid, argv, tag, user, cwd, pty:{cols,rows}|null, stdin:bool,
            keep_awake, started_ms, ended_ms, running, exit_code, timed_out,
            journal:{start, end, capacity}}
  Code contexts (kernels.py; one kernel each, ``default-python`` / ``default-bash`` start
  on first use):
  cnew      {tok, language:"python"|"bash", cwd, env} -> ok {context}
  clist     {tok}                  -> ok {contexts:[context...]}
  cdelete   {tok, ctx}             -> ok {ctx, deleted:true}
  cinterrupt {tok, ctx}            -> ok {ctx, interrupted:bool}
  crestart  {tok, ctx}             -> ok {context}: a fresh kernel under the same id, spec
  crun      {tok, ctx|null, language, code, timeout, env?} -> ``cev`` events, then ``ok``
            {context_id, execution_count, timed_out, lost?}. ``cancel`` interrupts it.
  context   {id, language, cwd, created_ms, executions, running}
  ls        {tok, path}            -> ok {path, entries:[{name,type,size}], truncated}
  read      {tok, path, limit:int} -> ok {path, size, truncated} + data
  write     {tok, path, meta?} + data  -> ok {path, bytesWritten}   (meta: xattrs.py's map,
                                    replacing the file's user.e2b.* xattrs)
  rm        {tok, path}            -> ok {path, deleted: true}  (a file or symlink, never a dir)
  ping      {}                     -> ok {}
  clock     {now_ns:int} | {adjust_ns:int} -> ok {wall_ns}  sets the wall clock to the
            host's (after a live resume: the guest's clocks stood still while its vCPUs
            were stopped), or moves it forward by ``adjust_ns`` (0 < adjust_ns <=
            MAX_CLOCK_ADJUST_NS: the host's correction for the delay the guest took to
            read the previous clock message), then a heartbeat.
  probe     {}                     -> ok {runnable:int, cpu_busy:int, cpu_total:int,
            timer_ms:int|null}: is the guest idle? ``runnable`` counts tasks running or
            in uninterruptible wait besides the prober; ``cpu_*`` are /proc/stat ticks
            (the host compares two probes); ``timer_ms`` is the nearest deadline of a
            sleeping task (a ``sleep``, a socket timeout, an exec's timeoutSecs), None if
            none. The harness keeps no such timer of its own, so every one it reports is
            the workload's.

Guest -> host kinds:
  hb        id 0: {vm_id, incarnation, active:bool, last_activity_ms:int, boot_id, uptime_s,
            mem_total, mem_used, disk_total, disk_used}  (bytes; the guest's own view, for
            metrics only; each may be missing)
  started   {pid}  first message of an exec stream
  out       {fd: 1|2, o:int} + data   (``o``: journal offset after this chunk)
  gap       {n:int}  output lost to the journal's bound before the next chunk
  cev       {t:"stream", name:"stdout"|"stderr", text} | {t:"result", mime:{type: str},
            main:bool} | {t:"error", name, value, traceback:[str]}  (a ``crun`` cell's events)
  exit      {code:int, timed_out:bool}
  ok        {result:{...}} (+ data for ``read``)
  err       {code: one of ERR_*, msg:str}

Requests other than identify/ping/cancel/detach/credit/clock/probe must carry ``tok`` equal to the current
incarnation's token; otherwise the harness answers ``err`` with ERR_AUTH. A restored VM
therefore refuses anything presenting a token frozen into its snapshot.
"""

from __future__ import annotations

import base64
import json
from typing import Any

PORT_NAME = "agent"  # virtserialport name; the guest finds /dev/vportNpM by it
CONFIG_MAGIC = b"PALCFG1\n"  # config drive: magic, then JSON spawn config, then NUL padding
WORKSPACE = "/workspace"
WORKLOAD_USER = "pal"
MAX_FILE_BYTES = 1024 * 1024  # files API limit (1 MiB)
MAX_LINE_BYTES = 8 * 1024 * 1024  # a peer sending longer lines is broken; drop them
MAX_CLOCK_ADJUST_NS = 60 * 10**9  # a clock correction beyond this is no read delay: ignored
# A process's output journal (journal.py): its default size and the sizes a start may ask.
JOURNAL_DEFAULT_BYTES = 8 * 1024 * 1024
JOURNAL_MIN_BYTES = 64 * 1024
JOURNAL_MAX_BYTES = 64 * 1024 * 1024
MAX_TAG_CHARS = 256  # a process's tag
# Code contexts (kernels.py): per VM, and per cell (the host checks them again).
MAX_CODE_CONTEXTS = 8
MAX_CODE_CHARS = 1024 * 1024  # one cell's source
MAX_CELL_STREAM_CHARS = 1024 * 1024  # stdout + stderr text and error events of one cell
# Every stream or error event of a cell counts this many characters besides its text (so a
# flood of tiny or empty ones is bounded too); Pal's own notes ("output cut ...") come out
# of a reserve past the bound. The guest and the host count alike (cell_event_chars).
CELL_EVENT_OVERHEAD = 64
CELL_NOTE_RESERVE = 4096
MAX_RESULT_JSON_DEPTH = 64  # an application/json result nested deeper is dropped
MAX_CELL_RESULTS = 64  # display results of one cell
MAX_RESULT_BYTES = 1024 * 1024  # one result's JSON (a PNG is base64): one host line holds it
MAX_CELL_RESULT_BYTES = 8 * 1024 * 1024  # all of one cell's results
STREAM_EVENT_CHARS = 128 * 1024  # stdout/stderr text per ``cev`` (JSON may escape a char to 6 bytes)
CODE_MIMES = ("text/plain", "text/html", "image/png", "image/svg+xml", "application/json")

# The guest's network, the same in every VM (each VM has its own namespace on the host):
# a static address, and the host side of its NIC as gateway and DNS server.
GUEST_IP = "10.0.2.15"
GATEWAY_IP = "10.0.2.2"
NET_PREFIX = 24
# The harness's port relay (portrelay.py) listens here on GUEST_IP, for the host only: it
# reaches servers bound to 127.0.0.1. A privileged port no workload would pick, bound at boot
# before any user code runs.
RELAY_PORT = 1

# Message kinds.
K_IDENTIFY = "identify"
K_EXEC = "exec"
K_CANCEL = "cancel"
K_LS = "ls"
K_READ = "read"
K_WRITE = "write"
K_RM = "rm"
K_PING = "ping"
K_CLOCK = "clock"
K_PROBE = "probe"
K_HEARTBEAT = "hb"
K_OUT = "out"
K_EXIT = "exit"
K_OK = "ok"
K_ERR = "err"
# Processes (processes.py): start, look up, read, follow, feed, signal, forget.
K_PSTART = "pstart"
K_PLIST = "plist"
K_PGET = "pget"
K_PREAD = "pread"
K_PATTACH = "pattach"
K_PSTDIN = "pstdin"
K_PSIGNAL = "psignal"
K_PRESIZE = "presize"
K_PWAIT = "pwait"
K_PDELETE = "pdelete"
K_DETACH = "detach"
K_CREDIT = "credit"
# Code contexts (kernels.py).
K_CNEW = "cnew"
K_CLIST = "clist"
K_CDELETE = "cdelete"
K_CINTERRUPT = "cinterrupt"
K_CRESTART = "crestart"
K_CRUN = "crun"
K_CEV = "cev"
# The workload user under another name (usernames.py: E2B's conventions).
K_URENAME = "urename"
# Directory watches (watches.py).
K_WNEW = "wnew"
K_WREAD = "wread"
K_WDEL = "wdel"
# Files' user metadata as xattrs (xattrs.py: E2B's X-Metadata-*).
K_XGET = "xget"
K_XSET = "xset"
# Guest -> host, inside an exec or pattach stream.
K_STARTED = "started"
K_GAP = "gap"

# Flow control: the replies a stream's credit holds back, and the host's default window.
FLOW_KINDS = frozenset({K_OUT, K_GAP, K_CEV})
STREAM_KINDS = frozenset({K_EXEC, K_PATTACH, K_CRUN})
STREAM_WINDOW = 1024 * 1024

# Error codes carried in ``err`` replies; the host maps them to HTTP statuses.
ERR_AUTH = "EAUTH"  # wrong or stale token
ERR_NOENT = "ENOENT"  # no such file, or executable not found
ERR_ESCAPE = "EESCAPE"  # path leaves /workspace (absolute, .., symlink)
ERR_TOOBIG = "ETOOBIG"  # write above MAX_FILE_BYTES
ERR_ISDIR = "EISDIR"
ERR_NOTDIR = "ENOTDIR"
ERR_INVAL = "EINVAL"  # malformed request
ERR_PERM = "EPERM"  # not executable / permission denied
ERR_TIMEOUT = "ETIMEDOUT"  # exec exceeded timeout (process killed)
ERR_IO = "EIO"  # anything else
ERR_STATE = "ESTATE"  # the process is not in a state for this (exited, no stdin, no terminal)
ERR_LIMIT = "ELIMIT"  # too many processes (or code contexts)
ERR_NOKERNEL = "ENOKERNEL"  # the image cannot run this language's kernel (no Jupyter)

Message = dict[str, Any]


def cell_event_chars(*texts: str) -> int:
    """What one cell event costs of MAX_CELL_STREAM_CHARS: its texts (a stream's text, or
    an error's name, value and traceback lines) and CELL_EVENT_OVERHEAD."""
    return CELL_EVENT_OVERHEAD + sum(len(x) for x in texts)


def encode(msg: Message, data: bytes | None = None) -> bytes:
    """One wire line for ``msg`` (with ``data`` base64-encoded into it when given)."""
    if data is not None:
        msg = dict(msg)
        msg["data"] = base64.b64encode(data).decode("ascii")
    return json.dumps(msg, separators=(",", ":")).encode("utf-8") + b"\n"


def decode(line: bytes) -> Message | None:
    """Parse one line; ``None`` for noise (blank, partial or corrupt lines are skipped)."""
    line = line.strip()
    if not line:
        return None
    try:
        msg = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(msg, dict) or "k" not in msg:
        return None
    return msg


def payload(msg: Message) -> bytes:
    """The binary payload of ``msg`` (empty when it has none)."""
    raw = msg.get("data")
    if not raw:
        return b""
    return base64.b64decode(raw)


def encode_config(config: Message, size: int = 64 * 1024) -> bytes:
    """Contents of the read-only config drive holding ``spawn.json``."""
    body = CONFIG_MAGIC + json.dumps(config).encode("utf-8") + b"\n"
    if len(body) > size:
        raise ValueError("spawn config too large for the config drive")
    return body + b"\0" * (size - len(body))


def decode_config(raw: bytes) -> Message | None:
    if not raw.startswith(CONFIG_MAGIC):
        return None
    body = raw[len(CONFIG_MAGIC) :].split(b"\n", 1)[0]
    try:
        cfg = json.loads(body)
    except ValueError:
        return None
    return cfg if isinstance(cfg, dict) else None
