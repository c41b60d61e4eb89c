"""The harness's code contexts, driven over a socketpair (tests/harnesshost.py): bash
contexts keep state between cells, a timeout interrupts the cell and the context stays,
contexts are isolated and bounded; the Python kernel's failure to start (no Jupyter in
the interpreter) is ENOKERNEL. The Python kernel itself runs in VMs
(tests/integration/test_code.py)."""

from __future__ import annotations

from typing import Any

from pal.guest import protocol as p
from pal.guest.kernels import CellBound, Kernels
from tests.harnesshost import TOKEN, Host


def run(h: Host, code: str, **fields: Any) -> tuple[list[p.Message], p.Message]:
    msgs = list(h.replies(h.send(p.K_CRUN, tok=TOKEN, code=code, **fields)))
    return [m for m in msgs if m["k"] == p.K_CEV], msgs[-1]


def text(events: list[p.Message], name: str = "stdout") -> str:
    return "".join(e["text"] for e in events if e["t"] == "stream" and e["name"] == name)


def test_bash_state_persists_and_errors_report(host: Host) -> None:
    _, end = run(host, "X=41; cd /tmp", language="bash")
    assert end["k"] == p.K_OK and end["result"]["context_id"] == "default-bash"
    evs, end = run(host, "echo $((X + 1)); pwd", language="bash")
    assert text(evs) == "42\n/tmp\n"
    assert end["result"]["execution_count"] == 2
    evs, end = run(host, "echo oops >&2; false", language="bash")
    assert "oops" in text(evs, "stderr")
    assert next(e for e in evs if e["t"] == "error")["value"] == "1"


def test_bash_timeout_interrupts_and_context_stays(host: Host) -> None:
    run(host, "Y=7", language="bash")
    evs, end = run(host, "while true; do :; done", language="bash", timeout=1)
    assert end["k"] == p.K_OK and end["result"]["timed_out"] is True
    evs, end = run(host, "echo $Y", language="bash")
    assert text(evs) == "7\n" and not end["result"]["timed_out"]


def test_contexts_are_isolated_listed_and_deleted(host: Host) -> None:
    a = host.call(p.K_CNEW, tok=TOKEN, language="bash")["result"]["context"]["id"]
    b = host.call(p.K_CNEW, tok=TOKEN, language="bash", env={"Z": "zz"})["result"]["context"]["id"]
    run(host, "V=a", ctx=a)
    evs, _ = run(host, 'echo "[$V][$Z]"', ctx=b)
    assert text(evs) == "[][zz]\n"
    listed = host.call(p.K_CLIST, tok=TOKEN)["result"]["contexts"]
    assert {c["id"] for c in listed} == {a, b}
    assert host.call(p.K_CDELETE, tok=TOKEN, ctx=a)["k"] == p.K_OK
    _, end = run(host, "echo", ctx=a)
    assert end["k"] == p.K_ERR and end["code"] == p.ERR_NOENT


def test_bad_requests_and_context_bound(host: Host) -> None:
    _, end = run(host, "1", language="cobol")
    assert end["code"] == p.ERR_INVAL
    _, end = run(host, "x" * (p.MAX_CODE_CHARS + 1), language="bash")
    assert end["code"] == p.ERR_INVAL
    for _ in range(p.MAX_CODE_CONTEXTS):
        assert host.call(p.K_CNEW, tok=TOKEN, language="bash")["k"] == p.K_OK
    end = host.call(p.K_CNEW, tok=TOKEN, language="bash")
    assert end["k"] == p.K_ERR and end["code"] == p.ERR_LIMIT


def test_output_is_bounded(host: Host) -> None:
    evs, end = run(host, f"head -c {p.MAX_CELL_STREAM_CHARS * 2} /dev/zero | tr '\\0' a", language="bash")
    assert end["k"] == p.K_OK
    out = [e for e in evs if e["t"] == "stream" and e["name"] == "stdout"]
    # Each event counts its overhead besides its text (protocol.cell_event_chars).
    assert len(text(evs)) == p.MAX_CELL_STREAM_CHARS - p.CELL_EVENT_OVERHEAD * len(out)
    assert "output and errors cut" in text(evs, "stderr")


def test_error_events_count_in_the_bound() -> None:
    """A kernel sending error events without end (showtraceback() in a loop) sends no more
    than the bound of text, said once; the host counts the same (pal/manager/code.py)."""
    sent: list[p.Message] = []
    bound = CellBound(lambda ev: sent.append(ev) or True)
    for _ in range(50_000):
        bound.forward(
            {"t": "error", "name": "ZeroDivisionError", "value": "x" * 50, "traceback": ["tb"] * 10}
        )
    errors = [e for e in sent if e["t"] == "error"]
    cost = sum(p.cell_event_chars(e["name"], e["value"], *e["traceback"]) for e in errors)
    notes = [e for e in sent if e["t"] == "stream"]
    assert cost <= p.MAX_CELL_STREAM_CHARS < cost + 200 and len(notes) == 1
    assert sum(p.cell_event_chars(e["text"]) for e in notes) <= p.CELL_NOTE_RESERVE


def test_python_without_jupyter_is_enokernel(host: Host) -> None:
    # The host's python3 has no jupyter_client (the default image's neither).
    _, end = run(host, "1 + 1", language="python")
    assert end["k"] == p.K_ERR and end["code"] == p.ERR_NOKERNEL, end


def test_kernels_start_nothing_until_asked() -> None:
    from pal.guest.children import ChildTracker

    assert Kernels(ChildTracker(False)).list() == []


def test_a_new_identity_reaches_running_kernels_and_keeps_a_contexts_own_env(host: Host) -> None:
    # What a restore, a fork or a pool claim does: the kernels started before it see the new
    # VM id, incarnation and secrets (not the old ones); a context's own variables stay.
    run(host, "true", language="bash")
    own = host.call(p.K_CNEW, tok=TOKEN, language="bash", env={"SECRET": "mine", "Z": "z"})
    own_id = own["result"]["context"]["id"]
    show = 'echo "$PAL_VM_ID $PAL_INCARNATION [$SECRET] [${NEW-unset}] [$Z]"'
    evs, _ = run(host, show, language="bash")
    assert text(evs) == "vm-1 1 [s3] [unset] []\n"
    ident = host.call(p.K_IDENTIFY, vm_id="vm-2", incarnation=3, token=TOKEN, env={"NEW": "n"})
    assert ident["k"] == p.K_OK
    evs, _ = run(host, show, language="bash")
    assert text(evs) == "vm-2 3 [] [n] []\n"
    evs, _ = run(host, show, ctx=own_id)
    assert text(evs) == "vm-2 3 [mine] [n] [z]\n"
