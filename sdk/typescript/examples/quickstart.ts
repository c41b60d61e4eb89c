// A project of your own using @pal-sandbox/sdk (installed from its packed tarball, see
// ../README.md). Compiled by `tsc` and run against a real server in Pal's tests
// (tests/e2e/test_typescript_sdk.py), so it keeps compiling as the SDK changes.
//
//   PAL_URL=http://127.0.0.1:8080 PAL_API_KEY=pal_... node quickstart.js
import { ConflictError, Pal, type ExecResult } from "@pal-sandbox/sdk";

const client = new Pal(); // PAL_URL, PAL_API_KEY from the environment

const { vmId } = await client.runtime.schedule({ limits: { memoryMib: 256 }, idleTimeoutSecs: 60 });
try {
  const res: ExecResult = await client.runtime.exec(vmId, {
    command: "/bin/sh",
    argv: ["-c", "echo hello from $(uname -s)"],
    timeoutSecs: 60,
  });
  console.log(`exit ${res.exitCode}: ${res.stdout.trim()}`);

  await client.runtime.writeFile(vmId, "notes.txt", "kept across a pause\n");
  const { snapshotId } = await client.runtime.pause(vmId);
  console.log(`paused, snapshot ${snapshotId ?? "none"}`);
  try {
    await client.runtime.exec(vmId, { command: "true" });
  } catch (err) {
    if (err instanceof ConflictError) console.log(`exec while paused: ${err.status} ${err.code}`);
    else throw err;
  }
  await client.runtime.resume(vmId);
  const { content } = await client.runtime.readFile(vmId, "notes.txt");
  console.log(`after resume: ${content.trim()}`);

  for await (const ev of client.runtime.execStream(vmId, { command: "/bin/sh", argv: ["-c", "echo a; echo b"] })) {
    if (ev.type === "exit") console.log(`stream exit ${ev.exitCode}`);
    else if (ev.type === "error") console.log(`stream error ${ev.code}: ${ev.message}`);
    else console.log(`${ev.type}: ${ev.data.trim()}`);
  }
} finally {
  await client.runtime.delete(vmId);
}
