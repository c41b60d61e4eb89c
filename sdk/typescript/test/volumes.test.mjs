// The volume calls against a real server (PAL_URL, PAL_API_KEY; PAL_OTHER_KEY: another
// tenant's key). tests/unit/test_volume_sdks.py serves the API (its node's real volume
// code, no VM) and runs this with `node --test`. A volume needs no VM.

import assert from "node:assert/strict";
import { test } from "node:test";

import { BadRequestError, ConflictError, NotFoundError, Pal, PalError } from "../dist/index.js";

const URL = process.env.PAL_URL;
const KEY = process.env.PAL_API_KEY;
const OTHER = process.env.PAL_OTHER_KEY;
if (!URL || !KEY || !OTHER) throw new Error("set PAL_URL, PAL_API_KEY and PAL_OTHER_KEY");

const pal = new Pal({ url: URL, apiKey: KEY });

async function expectError(promise, cls, status, code) {
  await assert.rejects(promise, (err) => {
    assert.ok(err instanceof cls && err instanceof PalError, `${err?.name}: ${err?.message}`);
    assert.equal(err.status, status);
    if (code) assert.equal(err.code, code);
    return true;
  });
}

test("volumes: create, list, get, resize, files, delete", async () => {
  const vol = await pal.volumes.create({ name: "ts-vol", sizeMib: 16, metadata: { sdk: "ts" } });
  assert.equal(vol.state, "ready");
  assert.match(vol.volumeId, /^vol-/);
  await expectError(pal.volumes.create({ name: "ts-vol" }), ConflictError, 409);
  assert.deepEqual((await pal.volumes.list({ metadata: { sdk: "ts" } })).map((v) => v.name), ["ts-vol"]);
  assert.deepEqual((await pal.volumes.get("ts-vol")).mountedBy, []);
  assert.equal((await pal.volumes.resize("ts-vol", 32)).sizeMib, 32);

  assert.deepEqual(await pal.volumes.writeFile("ts-vol", "dir/a.txt", "héllo"), { path: "dir/a.txt", bytesWritten: 6 });
  await pal.volumes.writeFile(vol.volumeId, "bin", new Uint8Array([0, 255, 1]));
  assert.deepEqual(await pal.volumes.readFile("ts-vol", "dir/a.txt"), { content: "héllo", truncated: false });
  const raw = await pal.volumes.readFileBytes("ts-vol", "bin");
  assert.deepEqual([...raw.content], [0, 255, 1]);
  const listed = await pal.volumes.listFiles("ts-vol", "", { depth: 2 });
  assert.deepEqual(listed.entries.map((e) => [e.path, e.type]), [["bin", "file"], ["dir", "dir"], ["dir/a.txt", "file"]]);
  assert.equal(listed.truncated, false);
  const st = await pal.volumes.stat("ts-vol", "dir/a.txt");
  assert.equal(st.size, 6);
  assert.equal(st.type, "file");
  assert.equal(await pal.volumes.exists("ts-vol", "dir/a.txt"), true);
  assert.equal(await pal.volumes.exists("ts-vol", "nope"), false);
  await expectError(pal.volumes.exists("no-such-volume", "x"), NotFoundError, 404, "NOT_FOUND");
  assert.deepEqual(await pal.volumes.makeDir("ts-vol", "p/q", { parents: true }), { path: "p/q", created: true });
  assert.deepEqual(await pal.volumes.makeDir("ts-vol", "p/q", { parents: true }), { path: "p/q", created: false });
  await expectError(pal.volumes.readFile("ts-vol", "../etc/passwd"), BadRequestError, 400, "PATH_ESCAPE");
  await expectError(pal.volumes.deleteFile("ts-vol", "p"), BadRequestError, 400);
  assert.deepEqual(await pal.volumes.deleteFile("ts-vol", "p", { recursive: true }), { path: "p", deleted: true });
  assert.deepEqual(await pal.volumes.deleteFile("ts-vol", "bin"), { path: "bin", deleted: true });
  await expectError(pal.volumes.stat("ts-vol", "bin"), NotFoundError, 404, "FILE_NOT_FOUND");

  // Another tenant sees none of it.
  const bob = new Pal({ url: URL, apiKey: OTHER });
  await expectError(bob.volumes.readFile("ts-vol", "dir/a.txt"), NotFoundError, 404);
  await expectError(bob.volumes.listFiles(vol.volumeId), NotFoundError, 404);
  await expectError(bob.volumes.writeFile(vol.volumeId, "x", "x"), NotFoundError, 404);

  assert.equal((await pal.volumes.delete("ts-vol")).state, "deleted");
  await expectError(pal.volumes.get("ts-vol"), NotFoundError, 404);
});
