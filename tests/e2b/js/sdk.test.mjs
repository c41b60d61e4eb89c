// The unmodified E2B JavaScript SDK and code interpreter against Pal's E2B surface.
// tests/e2b/test_sdk_js.py runs this under `node --test` with E2B_API_URL,
// E2B_SANDBOX_URL and E2B_API_KEY pointing at the servers it started.
import assert from 'node:assert/strict'
import { test } from 'node:test'
import { Sandbox, CommandExitError, NotFoundError, FilesystemEventType } from 'e2b'
import { Sandbox as CodeSandbox } from '@e2b/code-interpreter'

test('sandbox lifecycle and listing', async () => {
  const sbx = await Sandbox.create({ metadata: { suite: 'js' }, timeoutMs: 120_000 })
  const info = await sbx.getInfo()
  assert.equal(info.sandboxId, sbx.sandboxId)
  assert.deepEqual(info.metadata, { suite: 'js' })
  const page = await Sandbox.list({ query: { metadata: { suite: 'js' } } }).nextItems()
  assert.deepEqual(page.map((s) => s.sandboxId), [sbx.sandboxId])
  assert.equal(await sbx.pause(), true)
  assert.equal(await sbx.isRunning(), false)
  const again = await Sandbox.connect(sbx.sandboxId)
  assert.equal((await again.commands.run('echo back')).stdout, 'back\n')
  assert.equal(await sbx.kill(), true)
  assert.equal(await Sandbox.kill(sbx.sandboxId), false)
})

test('commands, stdin and exit codes', async () => {
  const sbx = await Sandbox.create()
  const out = await sbx.commands.run('echo hello')
  assert.equal(out.stdout, 'hello\n')
  await assert.rejects(sbx.commands.run('exit 4'), (err) => err instanceof CommandExitError && err.exitCode === 4)
  const cat = await sbx.commands.run('cat', { background: true, stdin: true })
  await sbx.commands.sendStdin(cat.pid, 'from js\n')
  await sbx.commands.closeStdin(cat.pid)
  assert.equal((await cat.wait()).stdout, 'from js\n')
  await sbx.kill()
})

test('files and watching', async () => {
  const sbx = await Sandbox.create()
  await sbx.files.write([
    { path: '/tmp/a.txt', data: 'A' },
    { path: '/tmp/b.txt', data: 'B' },
  ])
  assert.equal(await sbx.files.read('/tmp/b.txt'), 'B')
  assert.equal(await sbx.files.exists('/tmp/none'), false)
  assert.equal(await sbx.files.makeDir('/tmp/w'), true)
  const seen = []
  let arrived
  const first = new Promise((resolve) => (arrived = resolve))
  const watch = await sbx.files.watchDir('/tmp/w', (e) => {
    seen.push([e.name, e.type])
    arrived()
  })
  await sbx.files.write('/tmp/w/x.txt', 'x')
  await first
  await watch.stop()
  assert.deepEqual(seen, [['x.txt', FilesystemEventType.CREATE]])
  await assert.rejects(sbx.files.read('/tmp/missing.txt'), NotFoundError)
  await sbx.kill()
})

test('code interpreter', async () => {
  const sbx = await CodeSandbox.create()
  const first = await sbx.runCode('1 + 1')
  assert.equal(first.text, '1 + 1')
  assert.equal((await sbx.runCode('x')).executionCount, 2)
  const ctx = await sbx.createCodeContext({ cwd: '/tmp' })
  assert.equal(ctx.cwd, '/tmp')
  assert.equal((await sbx.runCode('y', { context: ctx })).executionCount, 1)
  await sbx.kill()
})
