// Kept snapshots against a real server (PAL_URL, PAL_API_KEY): keep one, start VMs from it
// with the source's tags or others (and secrets), fork with tags, let it go. tests/unit/test_kept_snapshot_sdks.py serves
// the API over its fake node and runs this with `node --test`.

import assert from "node:assert/strict";
import { test } from "node:test";

import { NotFoundError, Pal } from "../dist/index.js";

const URL = process.env.PAL_URL;
const KEY = process.env.PAL_API_KEY;
if (!URL || !KEY) throw new Error("set PAL_URL and PAL_API_KEY");

const pal = new Pal({ url: URL, apiKey: KEY });

test("kept snapshots: keep, start with the source's tags or others, delete", async () => {
  const vm = await pal.runtime.schedule({ metadata: { team: "ts" } });
  const kept = await pal.runtime.keepSnapshot(vm.vmId, "ts-golden");
  assert.equal(kept.name, "ts-golden");
  assert.deepEqual((await pal.runtime.keptSnapshots({ vmId: vm.vmId })).map((k) => k.snapshotId), [kept.snapshotId]);
  const forked = await pal.runtime.fork(vm.vmId, { count: 1, metadata: { run: "f" }, secrets: { A: "1" } });
  assert.equal(forked.forks[0].state, "running");
  assert.deepEqual((await pal.runtime.get(forked.forks[0].vmId)).metadata, { run: "f" });
  await pal.runtime.delete(forked.forks[0].vmId);
  await pal.runtime.delete(vm.vmId);

  const plain = await pal.runtime.startFromSnapshot("ts-golden");
  assert.deepEqual((await pal.runtime.get(plain.forks[0].vmId)).metadata, { team: "ts" });
  const tagged = await pal.runtime.startFromSnapshot(kept.snapshotId, 1, { metadata: { run: "7" }, secrets: { A: "2" } });
  assert.equal(tagged.forks[0].state, "running");
  assert.deepEqual((await pal.runtime.get(tagged.forks[0].vmId)).metadata, { run: "7" });

  assert.equal((await pal.runtime.deleteKeptSnapshot("ts-golden")).snapshotId, kept.snapshotId);
  await assert.rejects(pal.runtime.keptSnapshot("ts-golden"), NotFoundError);
});
