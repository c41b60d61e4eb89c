"""`pal vm code VM -c '...'` (or a file, or `-` for stdin): a cell in the VM's kernel.

Prints stdout and stderr, then the last expression's text (or an HTML result's note);
writes each image result (PNG, SVG) to a file (``--images DIR``, default the current
directory) and names it. Exits 1 when the cell raised, 124 when its timeout interrupted it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from .help import examples
from .output import api_errors, fail, note
from .vm import TIMEOUT_EXIT_CODE, VmId, client, vm_app


def _source(code: str | None, file: Path | None) -> str:
    if (code is None) == (file is None):
        fail("give the cell as -c CODE or as a FILE (`-`: stdin)", "INVALID_ARGUMENT", status=2)
    if code is not None:
        return code
    assert file is not None
    return sys.stdin.read() if str(file) == "-" else file.read_text()


@vm_app.command(
    "code",
    epilog=examples(
        "VM=$(pal vm schedule --image code-interpreter -q)",
        "pal vm code $VM -c 'x = 41'",
        "pal vm code $VM -c 'x + 1'",
        "pal vm code $VM plot.py --images out/",
        "pal vm code $VM --language bash -c 'cd /tmp && ls'",
    ),
)
def code_cmd(
    vm_id: VmId,
    file: Annotated[
        Path | None, typer.Argument(metavar="[FILE]", help="the cell's source (`-`: stdin)")
    ] = None,
    code: Annotated[str | None, typer.Option("-c", "--code", help="the cell's source")] = None,
    language: Annotated[str, typer.Option("--language", "-l", help="python or bash")] = "python",
    context: Annotated[str | None, typer.Option(help="context id (default: the language's default)")] = None,
    timeout: Annotated[
        float | None, typer.Option(metavar="SECS", help="interrupt the cell after SECS")
    ] = None,
    images: Annotated[Path, typer.Option(metavar="DIR", help="where image results are written")] = Path("."),
) -> None:
    """Run a cell in the VM's stateful kernel (Python: the code-interpreter image; bash: any)."""
    source = _source(code, file)
    with api_errors():
        res = client().runtime.run_code(
            vm_id, source, language=language, context=context, timeout_secs=timeout
        )
    sys.stdout.write(res.stdout)
    sys.stderr.write(res.stderr)
    count = res.execution_count or 0
    for i, out in enumerate(res.results):
        for ext, data in (("png", out.png), ("svg", out.svg.encode() if out.svg else None)):
            if data is not None:
                images.mkdir(parents=True, exist_ok=True)
                path = images / f"cell{count}-{i}.{ext}"
                path.write_bytes(data)
                note(f"image: {path}")
        if out.is_main_result and out.text is not None:
            print(out.text)
        elif out.html is not None and out.png is None:
            note(f"result {i}: HTML ({len(out.html)} characters); text: {out.text or ''}")
    if res.error is not None:
        sys.stderr.write("\n".join(res.error.traceback) + "\n")
    if res.timed_out:
        note("the cell timed out and was interrupted; its context stays")
        raise typer.Exit(TIMEOUT_EXIT_CODE)
    raise typer.Exit(1 if res.error is not None else 0)
