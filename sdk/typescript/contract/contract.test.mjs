// The shared SDK contract (sdk/contract/scenarios.json) against a real Pal server, under
// `node --test`. PAL_URL and PAL_API_KEY name the server and a tenant with room for the
// file's tenantMaxVms VMs; tests/e2e/test_sdk_contract.py starts a server and runs this
// (after `npm run build`). One test per scenario, named by its id, in the file's order.

import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { after, test } from "node:test";

import {
  AuthenticationError,
  BadRequestError,
  ConflictError,
  NotFoundError,
  Pal,
  PalError,
  PayloadTooLargeError,
  QuotaExceededError,
} from "../dist/index.js";

if (!process.env.PAL_URL || !process.env.PAL_API_KEY) throw new Error("set PAL_URL and PAL_API_KEY");

const file = JSON.parse(readFileSync(new URL("../../contract/scenarios.json", import.meta.url), "utf8"));
const client = new Pal();
const rt = client.runtime;
const st = { vm: "" };
const shell = (line) => ({ command: "/bin/sh", argv: ["-c", line] });

async function expectError(promise, cls, status, code) {
  await assert.rejects(promise, (err) => {
    assert.ok(err instanceof cls, `${err} is not a ${cls.name}`);
    assert.ok(err instanceof PalError);
    assert.equal(err.status, status);
    assert.equal(err.code, code);
    assert.ok(err.message && err.requestId, `message and requestId: ${err.message} ${err.requestId}`);
    return true;
  });
}

function needVm() {
  assert.ok(st.vm, "no VM: the schedule scenario failed");
}

const scenarios = {
  async schedule() {
    const vm = await rt.schedule({});
    assert.ok(vm.vmId);
    assert.equal(vm.state, "running");
    st.vm = vm.vmId;
    const got = await rt.get(st.vm);
    assert.equal(got.vmId, st.vm);
    assert.equal(got.state, "running");
    assert.ok((await rt.list()).some((v) => v.vmId === st.vm));
  },

  async "exec-buffered"() {
    needVm();
    const res = await rt.exec(st.vm, shell("echo out; echo err >&2; exit 3"));
    assert.deepEqual([res.exitCode, res.stdout, res.stderr], [3, "out\n", "err\n"]);
  },

  async "exec-stream"() {
    needVm();
    const events = [];
    for await (const ev of rt.execStream(st.vm, shell("echo one; echo two >&2; exit 5"))) events.push(ev);
    const join = (type) => events.filter((e) => e.type === type).map((e) => e.data).join("");
    assert.equal(join("stdout"), "one\n");
    assert.equal(join("stderr"), "two\n");
    const exits = events.filter((e) => e.type === "exit");
    assert.equal(exits.length, 1);
    assert.deepEqual(events.at(-1), { type: "exit", exitCode: 5 });
  },

  async "exec-stream-close"() {
    needVm();
    const seen = [];
    for await (const ev of rt.execStream(st.vm, shell("echo ready; exec sleep 600"))) {
      seen.push(ev);
      break; // leaving the loop closes the stream
    }
    assert.deepEqual(seen, [{ type: "stdout", data: "ready\n" }]);
    const res = await rt.exec(st.vm, shell("echo again"));
    assert.deepEqual([res.exitCode, res.stdout], [0, "again\n"]);
  },

  async "files-bytes"() {
    needVm();
    const data = Uint8Array.from({ length: 256 }, (_, i) => i);
    assert.equal((await rt.writeFile(st.vm, "contract/bin.dat", data)).bytesWritten, 256);
    const got = await rt.readFileBytes(st.vm, "contract/bin.dat");
    assert.equal(got.truncated, false);
    assert.deepEqual(got.content, data);
    const list = await rt.listFiles(st.vm, "contract");
    assert.ok(list.entries.some((e) => e.name === "bin.dat" && e.type === "file" && e.size === 256), JSON.stringify(list));
    assert.equal((await rt.deleteFile(st.vm, "contract/bin.dat")).deleted, true);
    await expectError(rt.readFileBytes(st.vm, "contract/bin.dat"), NotFoundError, 404, "FILE_NOT_FOUND");
  },

  async "pause-resume"() {
    needVm();
    await rt.writeFile(st.vm, "keep.txt", "kept");
    const paused = await rt.pause(st.vm);
    assert.equal(paused.state, "paused");
    assert.ok(paused.snapshotId);
    assert.equal((await rt.get(st.vm)).state, "paused");
    await expectError(rt.exec(st.vm, { command: "/bin/true" }), ConflictError, 409, "FAILED_PRECONDITION");
    const resumed = await rt.resume(st.vm);
    assert.deepEqual([resumed.vmId, resumed.state], [st.vm, "running"]);
    assert.equal((await rt.readFile(st.vm, "keep.txt")).content, "kept");
  },

  async fork() {
    needVm();
    const res = await rt.fork(st.vm, { count: 1 });
    assert.equal(res.sourceVmId, st.vm);
    assert.equal(res.forks.length, 1);
    const child = res.forks[0];
    try {
      assert.equal(child.state, "running");
      assert.ok(!child.error && child.vmId && child.vmId !== st.vm, JSON.stringify(child));
      assert.equal((await rt.readFile(child.vmId, "keep.txt")).content, "kept");
      assert.equal((await rt.get(child.vmId)).parentVmId, st.vm);
      assert.equal((await rt.delete(child.vmId)).state, "terminated");
    } finally {
      await rt.delete(child.vmId).catch(() => undefined);
    }
  },

  async errors() {
    needVm();
    await expectError(rt.get("vm-does-not-exist"), NotFoundError, 404, "NOT_FOUND");
    const stranger = new Pal({ apiKey: "pal_not_a_key" });
    await expectError(stranger.runtime.list(), AuthenticationError, 401, "UNAUTHENTICATED");
    await expectError(rt.readFile(st.vm, "../etc/passwd"), BadRequestError, 400, "PATH_ESCAPE");
    await expectError(rt.writeFile(st.vm, "big.bin", new Uint8Array(1024 * 1024 + 1)), PayloadTooLargeError, 413, "PAYLOAD_TOO_LARGE");
    await expectError(rt.resume(st.vm), ConflictError, 409, "FAILED_PRECONDITION");
    await expectError(rt.fork(st.vm, { count: 50 }), QuotaExceededError, 402, "QUOTA_EXCEEDED");
  },

  async delete() {
    needVm();
    assert.equal((await rt.delete(st.vm)).state, "terminated");
    st.vm = "";
  },

  async processes() {
    const pvm = (await rt.schedule({})).vmId;
    try {
      await processScenario(rt.processes, pvm);
    } finally {
      assert.equal((await rt.delete(pvm)).state, "terminated");
    }
  },

  async metadata() {
    const run = unique();
    const tags = { sdk: "typescript", run };
    const m = (await rt.schedule({ metadata: tags })).vmId;
    let child = "";
    try {
      assert.deepEqual((await rt.get(m)).metadata, tags);
      child = (await rt.fork(m, { count: 1 })).forks[0].vmId;
      const got = await rt.get(child);
      assert.deepEqual([got.metadata, got.forkedFrom], [tags, m]);
      assert.deepEqual((await rt.list({ metadata: { run } })).map((v) => v.vmId), [m, child]);
      assert.deepEqual(await rt.list({ metadata: { run, sdk: "nobody" } }), []);
      await expectError(rt.schedule({ metadata: { "bad key": "x" } }), BadRequestError, 400, "INVALID_ARGUMENT");
    } finally {
      for (const vm of [child, m]) if (vm) assert.equal((await rt.delete(vm)).state, "terminated");
    }
  },

  async lifetime() {
    const vm = await rt.schedule({ lifetimeSecs: 3600, onLifetimeEnd: "delete" });
    try {
      assert.deepEqual([vm.lifetimeSecs, vm.onLifetimeEnd], [3600, "delete"]);
      assert.ok(vm.lifetimeEndsAt);
      assert.equal((await rt.extendLifetime(vm.vmId, 60)).lifetimeSecs, 3660);
      assert.equal((await rt.setLifetime(vm.vmId, { lifetimeSecs: 1 })).lifetimeSecs, 1);
      await poll(`${vm.vmId} terminated`, async () => (await rt.get(vm.vmId)).state === "terminated");
      const ended = (await rt.events(vm.vmId)).filter((e) => e.kind === "lifetime_ended");
      assert.deepEqual(ended.map((e) => e.details?.action), ["deleted"]);
    } finally {
      await rt.delete(vm.vmId).catch(() => undefined);
    }
  },

  async volumes() {
    const name = `c-${Date.now().toString(36)}-${Math.random().toString(36).slice(2, 8)}`;
    const v = await client.volumes.create({ name, sizeMib: 8 });
    assert.deepEqual([v.state, v.sizeMib], ["ready", 8]);
    try {
      const wrote = await client.volumes.writeFile(name, "dir/a.bin", new Uint8Array([0, 255, 1, 2]));
      assert.deepEqual(wrote, { path: "dir/a.bin", bytesWritten: 4 });
      const got = await client.volumes.readFileBytes(name, "dir/a.bin");
      assert.deepEqual([[...got.content], got.truncated], [[0, 255, 1, 2], false]);
      const listed = (await client.volumes.listFiles(name, "", { depth: 2 })).entries;
      assert.deepEqual(listed.map((e) => [e.path, e.type]), [["dir", "dir"], ["dir/a.bin", "file"]]);
      assert.equal((await client.volumes.stat(name, "dir/a.bin")).size, 4);
      assert.equal(await client.volumes.exists(name, "nope"), false);
      await expectError(client.volumes.readFileBytes(name, "../escape"), BadRequestError, 400, "PATH_ESCAPE");
      assert.equal((await client.volumes.deleteFile(name, "dir", { recursive: true })).deleted, true);
    } finally {
      assert.equal((await client.volumes.delete(v.volumeId)).state, "deleted");
    }
    await expectError(client.volumes.get(v.volumeId), NotFoundError, 404, "NOT_FOUND");
  },

  async pagination() {
    const page = unique();
    const p1 = (await rt.schedule({ metadata: { page } })).vmId;
    const p2 = (await rt.schedule({ metadata: { page } })).vmId;
    try {
      const seen = [];
      for await (const vm of rt.iterVms({ metadata: { page }, pageSize: 1 })) seen.push(vm.vmId);
      assert.deepEqual(seen, [p1, p2]);
      const events = await collect(rt.iterEvents(p1, { pageSize: 1 }));
      assert.ok(events.length > 0);
      assert.deepEqual(events, await rt.events(p1));
      const images = await collect(client.iterImages({ pageSize: 1 }));
      assert.ok(images.length > 0);
      assert.deepEqual(images, await client.images());
      assert.deepEqual(await collect(rt.iterSnapshots(p1, { pageSize: 1 })), await rt.snapshots(p1));
      const bad = client.json("get", "/v1/runtime/vms", { query: { cursor: "not-a-cursor" } });
      await expectError(bad, BadRequestError, 400, "INVALID_ARGUMENT");
    } finally {
      for (const vm of [p1, p2]) assert.equal((await rt.delete(vm)).state, "terminated");
    }
  },
};

const P_SCRIPT = 'echo ready; while IFS= read -r l; do echo "got:$l"; done; echo eof; exit 3';
const Q_SCRIPT = 'trap "echo caught; exit 42" INT; echo armed; while :; do sleep 1; done';
const R_SCRIPT = "i=0; while :; do i=$((i+1)); echo tick $i; [ -e /tmp/stop ] && exit 0; sleep 0.2; done";
const text = (bytes) => new TextDecoder().decode(bytes);

// Every event of an output iterator (`onEvent` may act as they come): stdout joined as text,
// the events, and the checks that each stdout offset follows its bytes and one exit is last.
async function follow(iter, onEvent = () => {}) {
  let out = "";
  const seen = [];
  for await (const ev of iter) {
    seen.push(ev);
    if (ev.type === "stdout") out += text(ev.data);
    await onEvent(out);
  }
  assert.equal(seen.filter((e) => e.type === "exit").length, 1);
  assert.equal(seen.at(-1).type, "exit");
  return { out, seen, exit: seen.at(-1) };
}

async function processScenario(pr, vm) {
  const p = await pr.start(vm, { ...shell(P_SCRIPT), stdin: true, tag: "contract" });
  assert.ok(Number.isInteger(p.processId) && p.running, JSON.stringify(p));
  assert.ok((await pr.list(vm)).some((x) => x.processId === p.processId && x.tag === "contract"));
  await pr.sendStdin(vm, p.processId, "hello\n");
  await pr.closeStdin(vm, p.processId);
  const first = await follow(pr.output(vm, p.processId, 0));
  assert.equal(first.out, "ready\ngot:hello\neof\n");
  assert.equal(first.exit.exitCode, 3);
  let base = 0;
  for (const ev of first.seen.filter((e) => e.type === "stdout")) {
    base += ev.data.length;
    assert.equal(ev.offset, base);
  }
  const done = await pr.wait(vm, p.processId);
  assert.deepEqual([done.running, done.exitCode], [false, 3]);
  const again = await follow(pr.output(vm, p.processId, 6));
  assert.deepEqual([again.out, again.exit.exitCode], ["got:hello\neof\n", 3]);

  const q = (await pr.start(vm, shell(Q_SCRIPT))).processId;
  let signalled = false;
  const sig = await follow(pr.output(vm, q), async (out) => {
    if (out.includes("armed") && !signalled) {
      signalled = true;
      await pr.signal(vm, q, "INT");
    }
  });
  assert.ok(sig.out.includes("caught"), sig.out);
  assert.equal(sig.exit.exitCode, 42);

  const t = await pr.terminal(vm, { ...shell("stty size; read x; stty size"), cols: 80, rows: 24 });
  let resized = false;
  const term = await follow(t.output(), async (out) => {
    if (out.includes("24 80") && !resized) {
      resized = true;
      await t.resize(100, 30);
      await t.write("\n");
    }
  });
  assert.ok(term.out.indexOf("24 80") >= 0 && term.out.indexOf("24 80") < term.out.indexOf("30 100"), term.out);
  assert.equal(term.exit.exitCode, 0);

  const r = (await pr.start(vm, shell(R_SCRIPT))).processId;
  let resumer;
  const paused = await follow(pr.output(vm, r), async (out) => {
    if (out.includes("tick 3\n") && !resumer) {
      assert.equal((await rt.pause(vm, { mode: "live" })).state, "paused");
      // resumed while the iterator waits: it reattaches by itself
      resumer = rt.resume(vm).then(() => rt.exec(vm, shell("touch /tmp/stop")));
    }
  });
  await resumer;
  const lines = paused.out.split("\n").slice(0, -1);
  assert.ok(lines.length >= 3, paused.out);
  assert.deepEqual(lines, lines.map((_, i) => `tick ${i + 1}`));
  assert.equal(paused.exit.exitCode, 0);

  const s = (await pr.start(vm, { command: "sleep", argv: ["600"] })).processId;
  assert.equal((await pr.kill(vm, s)).deleted, true);
  await expectError(pr.get(vm, s), NotFoundError, 404, "PROCESS_NOT_FOUND");
}

function unique() {
  return Math.random().toString(16).slice(2, 14);
}

async function collect(items) {
  const out = [];
  for await (const item of items) out.push(item);
  return out;
}

// A hang guard, not a speed bound: the test server sweeps lifetimes every second.
async function poll(what, fn) {
  const deadline = Date.now() + 300_000;
  while (Date.now() < deadline) {
    if (await fn()) return;
    await new Promise((r) => setTimeout(r, 250));
  }
  assert.fail(`never: ${what}`);
}

const listed = new Set(file.scenarios.map((s) => s.id));
for (const id of Object.keys(scenarios)) {
  if (!listed.has(id)) throw new Error(`the TypeScript runner implements ${id}, which scenarios.json does not list`);
}
for (const sc of file.scenarios) {
  if (sc.status === "todo") test(sc.id, { skip: sc.note }, () => {});
  else if (!scenarios[sc.id]) test(sc.id, () => assert.fail(`scenario ${sc.id} has no TypeScript implementation`));
  else test(sc.id, { timeout: 600_000 }, scenarios[sc.id]);
}

after(async () => {
  if (st.vm) await rt.delete(st.vm).catch(() => undefined);
});
