// The SDK against a real `pal up` with real microVMs (PAL_URL, PAL_API_KEY; the tenant must
// have room for exactly 3 VMs). tests/e2e/test_typescript_sdk.py starts it and runs this
// with `node --test`. Every call, execStream's ordering, and the error types.

import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";

import {
  AuthenticationError,
  BadRequestError,
  ConflictError,
  NotFoundError,
  Pal,
  PalConnectionError,
  PalError,
  PayloadTooLargeError,
  QuotaExceededError,
  SseParser,
} from "../dist/index.js";

const URL = process.env.PAL_URL;
const KEY = process.env.PAL_API_KEY;
if (!URL || !KEY) throw new Error("set PAL_URL and PAL_API_KEY (a tenant with max 3 VMs)");

const client = new Pal(); // PAL_URL and PAL_API_KEY from the environment
const made = [];

async function collect(iter) {
  const out = [];
  for await (const ev of iter) out.push(ev);
  return out;
}

async function expectError(promise, cls, status, code) {
  await assert.rejects(promise, (err) => {
    assert.ok(err instanceof cls, `${err?.name}: ${err?.message}`);
    assert.ok(err instanceof PalError);
    assert.equal(err.status, status);
    if (code) assert.equal(err.code, code);
    assert.ok(err.message.length > 0);
    return true;
  });
}

describe("Pal TypeScript SDK against a real server", () => {
  let vmId;

  before(async () => {
    assert.equal(client.url, URL.replace(/\/+$/, ""));
    const vm = await client.runtime.schedule({ limits: { memoryMib: 256 }, idleTimeoutSecs: 0 });
    vmId = vm.vmId;
    made.push(vmId);
    assert.equal(vm.state, "running");
    assert.match(vmId, /^vm-[0-9a-f]{24}$/);
  });

  after(async () => {
    for (const id of made) await client.runtime.delete(id).catch(() => undefined);
  });

  test("an id is one path segment: text pasted into it is refused as an id, never another route", async () => {
    await expectError(client.runtime.get(`${vmId}/resume?x=`), BadRequestError, 400, "INVALID_ARGUMENT");
    await expectError(client.runtime.pause(`${vmId}/../${vmId}`), BadRequestError, 400, "INVALID_ARGUMENT");
    assert.equal((await client.runtime.get(vmId)).vmId, vmId);
  });

  test("get and list", async () => {
    const vm = await client.runtime.get(vmId);
    assert.equal(vm.vmId, vmId);
    assert.equal(vm.limits.memoryMib, 256);
    const vms = await client.runtime.list();
    assert.ok(vms.some((v) => v.vmId === vmId));
    const def = (await client.images()).find((i) => i.name === "default");
    assert.ok(def && def.digest.startsWith("sha256-") && def.user === "pal");
  });

  test("exec buffers stdout, stderr and the exit code", async () => {
    const res = await client.runtime.exec(vmId, { command: "/bin/sh", argv: ["-c", "echo out; echo err >&2; exit 3"] });
    assert.deepEqual([res.exitCode, res.stdout, res.stderr], [3, "out\n", "err\n"]);
  });

  test("execStream yields output in order as it happens, then exit", async () => {
    const started = Date.now();
    const seen = [];
    for await (const ev of client.runtime.execStream(vmId, {
      command: "/bin/sh",
      argv: ["-c", "for i in 1 2 3; do echo line$i; sleep 0.4; done; echo bad >&2; exit 7"],
    })) {
      seen.push({ ...ev, at: Date.now() - started });
    }
    const out = seen.filter((e) => e.type === "stdout").map((e) => e.data).join("");
    assert.equal(out, "line1\nline2\nline3\n");
    assert.deepEqual(seen.filter((e) => e.type === "stderr").map((e) => e.data), ["bad\n"]);
    const last = seen.at(-1);
    assert.equal(last.type, "exit");
    assert.equal(last.exitCode, 7);
    // streamed, not buffered: the first line arrived well before the exit
    const first = seen.find((e) => e.type === "stdout");
    assert.ok(last.at - first.at >= 700, JSON.stringify(seen));
    assert.deepEqual(
      [...new Set(seen.map((e) => e.type))],
      ["stdout", "stderr", "exit"],
      "stdout chunks, then stderr, then exit",
    );
  });

  test("execStream reports a missing executable as an error event", async () => {
    const events = await collect(client.runtime.execStream(vmId, { command: "/no/such/binary" }));
    assert.equal(events.length, 1);
    assert.equal(events[0].type, "error");
    assert.equal(events[0].code, "EXECUTABLE_NOT_FOUND");
    assert.match(events[0].message, /no\/such\/binary/);
    assert.equal(events[0].data, `EXECUTABLE_NOT_FOUND: ${events[0].message}\n`); // printable, as stdout's
  });

  test("leaving execStream early stops the command", async () => {
    for await (const ev of client.runtime.execStream(vmId, { command: "/bin/sh", argv: ["-c", "echo go; sleep 30; echo never"] })) {
      assert.deepEqual(ev, { type: "stdout", data: "go\n" });
      break;
    }
    // The server sees the stream close and cancels the command: poll until the sleep is gone.
    const deadline = Date.now() + 60_000;
    for (;;) {
      const ps = await client.runtime.exec(vmId, { command: "/bin/sh", argv: ["-c", "pgrep -x sleep || true"] });
      if (ps.stdout.trim() === "") break;
      assert.ok(Date.now() < deadline, `the command still runs: ${ps.stdout}`);
    }
  });

  test("files: write text and bytes, read both ways, list", async () => {
    const written = await client.runtime.writeFile(vmId, "job.py", "print('hi')");
    assert.deepEqual(written, { path: "job.py", bytesWritten: 11 });
    const { content, truncated } = await client.runtime.readFile(vmId, "job.py");
    assert.equal(content, "print('hi')");
    assert.equal(truncated, false);

    const bytes = new Uint8Array(256).map((_, i) => i);
    await client.runtime.writeFile(vmId, "dir/blob.bin", bytes);
    const back = await client.runtime.readFileBytes(vmId, "dir/blob.bin");
    assert.deepEqual(back.content, bytes);

    const { entries } = await client.runtime.listFiles(vmId);
    const names = entries.map((e) => e.name).sort();
    assert.ok(names.includes("job.py") && names.includes("dir"), JSON.stringify(entries));
    const sub = await client.runtime.listFiles(vmId, "dir");
    assert.deepEqual(sub.entries.map((e) => [e.name, e.size]), [["blob.bin", 256]]);
    const run = await client.runtime.exec(vmId, { command: "python3", argv: ["job.py"] });
    assert.equal(run.stdout, "hi\n");
  });

  test("typed errors: 400, 404, 413, 401, connection", async () => {
    await expectError(client.runtime.readFile(vmId, "../etc/passwd"), BadRequestError, 400, "PATH_ESCAPE");
    await expectError(client.runtime.get("vm-000000000000000000000000"), NotFoundError, 404, "NOT_FOUND");
    await expectError(
      client.runtime.writeFile(vmId, "big.bin", new Uint8Array(1024 * 1024 + 1)),
      PayloadTooLargeError,
      413,
    );
    await expectError(new Pal({ url: URL, apiKey: "pal_wrong" }).runtime.list(), AuthenticationError, 401);
    await expectError(new Pal({ url: "http://127.0.0.1:9", apiKey: KEY }).runtime.list(), PalConnectionError, 0);
    await assert.rejects(
      collect(client.runtime.execStream("vm-000000000000000000000000", { command: "true" })),
      NotFoundError,
    );
  });

  test("metrics, events and snapshots", async () => {
    const m = await client.runtime.metrics(vmId);
    assert.equal(m.vmId, vmId);
    assert.equal(m.intervalSecs, 5);
    assert.ok(Array.isArray(m.samples));
    const events = await client.runtime.events(vmId);
    assert.ok(events.some((e) => e.toState === "running"));
    assert.deepEqual(await client.runtime.snapshots(vmId), []);
  });

  test("setEgress changes the policy (an event says so); a bad entry is a 400 naming it", async () => {
    const vm = await client.runtime.setEgress(vmId, { allow: ["example.test"] });
    assert.deepEqual([vm.vmId, vm.egress], [vmId, { allow: ["example.test"] }]);
    assert.deepEqual((await client.runtime.get(vmId)).egress, { allow: ["example.test"] });
    await assert.rejects(client.runtime.setEgress(vmId, { allow: ["bad entry!"] }), (err) => {
      assert.ok(err instanceof BadRequestError && err.status === 400 && err.message.includes("bad entry!"), String(err));
      return true;
    });
    assert.equal((await client.runtime.setEgress(vmId, "none")).egress, "none");
    const changes = (await client.runtime.events(vmId)).filter((e) => e.kind === "egress_changed");
    assert.equal(changes.length, 2, JSON.stringify(changes));
  });

  test("live pause: the same VM stops in place, GET shows the kind, resume continues it", async () => {
    const paused = await client.runtime.pause(vmId, { mode: "live" });
    assert.deepEqual([paused.state, paused.pause?.kind, paused.pause?.by], ["paused", "live", "operator"]);
    await expectError(client.runtime.exec(vmId, { command: "true" }), ConflictError, 409);
    assert.equal((await client.runtime.get(vmId)).pause?.kind, "live");
    const resumed = await client.runtime.resume(vmId);
    assert.equal(resumed.state, "running");
    assert.equal("pause" in resumed, false);
    assert.equal("pause" in (await client.runtime.get(vmId)), false);
    assert.equal((await client.runtime.readFile(vmId, "job.py")).content, "print('hi')");
  });

  test("pause, 409 while paused, resume under the same id, fork x2, then 402", async () => {
    const paused = await client.runtime.pause(vmId);
    assert.equal(paused.state, "paused");
    assert.match(paused.snapshotId, /^snap-/);
    await expectError(client.runtime.exec(vmId, { command: "true" }), ConflictError, 409, "FAILED_PRECONDITION");
    await expectError(client.runtime.pause(vmId), ConflictError, 409);
    assert.equal((await client.runtime.snapshots(vmId)).length, 1);

    const resumed = await client.runtime.resume(vmId);
    assert.deepEqual([resumed.vmId, resumed.state], [vmId, "running"]);
    assert.equal((await client.runtime.readFile(vmId, "job.py")).content, "print('hi')"); // same disk

    const { sourceVmId, forks } = await client.runtime.fork(vmId, { count: 2 });
    for (const f of forks) made.push(f.vmId);
    assert.equal(sourceVmId, vmId);
    assert.deepEqual(forks.map((f) => [f.state, f.error]), [["running", undefined], ["running", undefined]]);
    const child = await client.runtime.readFile(forks[0].vmId, "job.py");
    assert.equal(child.content, "print('hi')");
    assert.equal((await client.runtime.get(forks[1].vmId)).parentVmId, vmId);

    // 3 of 3 slots used: a schedule (and a resume of a paused VM) answer 402
    await expectError(client.runtime.schedule(), QuotaExceededError, 402, "QUOTA_EXCEEDED");

    const gone = await client.runtime.delete(forks[0].vmId);
    assert.equal(gone.state, "terminated");
  });
});

describe("SseParser", () => {
  test("joins events split across chunks, skips comments, handles CRLF", () => {
    const p = new SseParser();
    const got = [
      ...p.feed("event: std"),
      ...p.feed("out\ndata: {\"data\":\"a\"}\n"),
      ...p.feed("\n: keepalive\n\r\nevent: exit\r\ndata: {\"exitCode\":0}\r\n\r\n"),
    ];
    assert.deepEqual(got, [
      { event: "stdout", data: '{"data":"a"}' },
      { event: "exit", data: '{"exitCode":0}' },
    ]);
    assert.deepEqual(p.feed("data: x"), []);
    assert.deepEqual(p.end(), [{ event: "message", data: "x" }]);
  });
});
