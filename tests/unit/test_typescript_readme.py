"""The TypeScript SDK's README compiles: every ```ts block of sdk/typescript/README.md,
in order (later blocks use the `client` and `vmId` of earlier ones), type-checked with the
project's own tsc (strict, as the SDK builds) against the SDK's sources. The spec's
examples are in it verbatim, execStream's loop included."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

SDK = Path(__file__).resolve().parents[2] / "sdk" / "typescript"
TSC = SDK / "node_modules" / ".bin" / "tsc"
# The SDK has no Node types (no runtime dependency, none at build time either): the README's
# few uses of Node's globals are declared for the check, as @types/node would.
NODE_GLOBALS = """
declare const process: {
  env: Record<string, string | undefined>;
  stdout: { write(chunk: string | Uint8Array): boolean };
};
"""
# The spec's example of execStream (quoted in sdk/typescript/README.md), as users copy it.
SPEC_EXEC_STREAM = """for await (const ev of client.runtime.execStream(vmId, {
  command: "/bin/sh",
  argv: ["-c", "pip install -q requests && python job.py"],
})) {
  if (ev.type === "exit") console.log("exit", ev.exitCode);
  else process.stdout.write(ev.data);                     // stdout | stderr
}"""


def ts_blocks(readme: str) -> list[str]:
    return re.findall(r"^```ts\n(.*?)^```", readme, re.M | re.S)


def test_the_readmes_typescript_compiles_against_the_sdk(tmp_path: Path) -> None:
    if not TSC.exists() or not shutil.which("node"):
        pytest.fail(
            "node and the SDK's dev dependencies are missing: scripts/install.sh (npm ci in sdk/typescript)"
        )
    blocks = ts_blocks((SDK / "README.md").read_text())
    assert len(blocks) >= 4, blocks
    assert any(SPEC_EXEC_STREAM in b for b in blocks), (
        "the README must carry the spec's execStream loop verbatim"
    )
    (tmp_path / "readme.mts").write_text(NODE_GLOBALS + "\n".join(blocks) + "\nexport {};\n")
    (tmp_path / "tsconfig.json").write_text(
        json.dumps(
            {
                "extends": str(SDK / "tsconfig.json"),
                "compilerOptions": {
                    "noEmit": True,
                    "rootDir": "/",  # the snippets and the SDK sources: nothing is emitted
                    "paths": {"@pal-sandbox/sdk": [str(SDK / "src" / "index.ts")]},
                    "noUnusedLocals": False,  # snippets bind values they only show
                },
                "include": [str(tmp_path / "readme.mts")],
            }
        )
    )
    res = subprocess.run(
        [str(TSC), "-p", str(tmp_path / "tsconfig.json")], capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stdout + res.stderr
