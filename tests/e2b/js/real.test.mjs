// The unmodified E2B JavaScript SDK against a real `pal up` and real VMs (one at a time).
// tests/e2b/test_real_js.py runs this under `node --test` with E2B_API_URL,
// E2B_SANDBOX_URL and E2B_API_KEY pointing at that server.
import assert from 'node:assert/strict'
import { test } from 'node:test'
import { Sandbox, CommandExitError, NotFoundError } from 'e2b'

test('a real sandbox: create, commands, files, list, kill, a named snapshot', async () => {
  const sbx = await Sandbox.create({ metadata: { suite: 'real-js' }, timeoutMs: 600_000 })
  let snap
  try {
    const out = await sbx.commands.run('echo hello; whoami; pwd')
    assert.equal(out.stdout, 'hello\nuser\n/home/user\n')
    await assert.rejects(sbx.commands.run('exit 4'), (err) => err instanceof CommandExitError && err.exitCode === 4)
    const cat = await sbx.commands.run('cat', { background: true, stdin: true })
    await sbx.commands.sendStdin(cat.pid, 'from js\n')
    await sbx.commands.closeStdin(cat.pid)
    assert.equal((await cat.wait()).stdout, 'from js\n')
    await sbx.files.write([
      { path: '/tmp/a.txt', data: 'A' },
      { path: 'b.txt', data: 'B' },
    ])
    assert.equal(await sbx.files.read('/home/user/b.txt'), 'B')
    assert.equal(await sbx.files.exists('/tmp/none'), false)
    await assert.rejects(sbx.files.read('/tmp/missing.txt'), NotFoundError)
    const page = await Sandbox.list({ query: { metadata: { suite: 'real-js' } } }).nextItems()
    assert.deepEqual(page.map((s) => s.sandboxId), [sbx.sandboxId])
    snap = await sbx.createSnapshot({ name: 'real-js-snapshot' })
    assert.deepEqual(snap.names, ['real-js-snapshot'])
  } finally {
    assert.equal(await sbx.kill(), true)
  }
  assert.equal(await Sandbox.kill(sbx.sandboxId), false)
  // The named snapshot outlives its sandbox: a new sandbox from it has its files.
  const listed = await Sandbox.listSnapshots({ sandboxId: sbx.sandboxId }).nextItems()
  assert.deepEqual(listed.map((s) => s.snapshotId), [snap.snapshotId])
  const child = await Sandbox.create(snap.snapshotId, { timeoutMs: 600_000 })
  try {
    assert.notEqual(child.sandboxId, sbx.sandboxId)
    assert.equal(await child.files.read('/home/user/b.txt'), 'B')
  } finally {
    assert.equal(await child.kill(), true)
  }
  assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId), true)
  assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId), false)
})
