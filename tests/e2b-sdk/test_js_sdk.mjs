// E2B's official JavaScript SDKs (`e2b`, `@e2b/code-interpreter`), unmodified, against a
// `cube serve` that scripts/test-e2b-sdks.sh started (E2B_API_URL, E2B_SANDBOX_URL,
// E2B_API_KEY); and the server's dashboard in headless Chromium.
import { test, after } from 'node:test'
import assert from 'node:assert/strict'
import { randomBytes } from 'node:crypto'
import { existsSync } from 'node:fs'
import { Sandbox as Base, AuthenticationError, CommandExitError } from 'e2b'
import { Sandbox } from '@e2b/code-interpreter'

const run = randomBytes(4).toString('hex')
const meta = { suite: run }
const made = []
async function create(S = Sandbox, opts = {}) {
  const s = await S.create({ metadata: meta, ...opts })
  made.push(s)
  return s
}
after(async () => {
  for (const s of made) await s.kill().catch(() => {})
})

test('runCode keeps state and reports errors and output', async () => {
  const sb = await create()
  await sb.runCode('x = 41')
  assert.equal((await sb.runCode('x + 1')).text, '42')
  const ex = await sb.runCode("import sys\nprint('out')\nprint('err', file=sys.stderr)\n1/0")
  assert.deepEqual(ex.logs.stdout, ['out\n'])
  assert.deepEqual(ex.logs.stderr, ['err\n'])
  assert.equal(ex.error.name, 'ZeroDivisionError')
  assert.equal((await sb.runCode('x')).text, '41')
})

test('files round trip, text and 1 MiB binary', async () => {
  const sb = await create(Base)
  await sb.files.write('/home/user/hello.txt', 'hello from js\n')
  assert.equal(await sb.files.read('/home/user/hello.txt'), 'hello from js\n')
  const blob = randomBytes(1 << 20)
  await sb.files.write('/home/user/blob.bin', blob.buffer.slice(blob.byteOffset, blob.byteOffset + blob.length))
  const back = Buffer.from(await sb.files.read('/home/user/blob.bin', { format: 'bytes' }))
  assert.ok(back.equals(blob))
  const names = (await sb.files.list('/home/user')).map((e) => e.name).sort()
  assert.deepEqual(names, ['blob.bin', 'hello.txt'])
  assert.equal(await sb.files.exists('/home/user/nope'), false)
})

test('commands: exit codes, env, background and kill', async () => {
  const sb = await create(Base)
  const r = await sb.commands.run('echo $GREETING', { envs: { GREETING: 'hi' } })
  assert.equal(r.stdout, 'hi\n')
  await assert.rejects(sb.commands.run('exit 4'), (e) => e instanceof CommandExitError && e.exitCode === 4)
  const h = await sb.commands.run('sleep 60', { background: true })
  assert.ok((await sb.commands.list()).some((p) => p.pid === h.pid))
  assert.equal(await h.kill(), true)
  await assert.rejects(h.wait())
})

test('pty: typed input and a resize', async () => {
  const sb = await create(Base)
  let shown = ''
  const text = new TextDecoder()
  const term = await sb.pty.create({ rows: 33, cols: 77, onData: (d) => { shown += text.decode(d) } })
  const typed = new TextEncoder()
  await sb.pty.sendInput(term.pid, typed.encode('stty size; echo mark-$((40+2))\n'))
  for (let i = 0; i < 300 && !shown.includes('mark-42'); i++) await new Promise((r) => setTimeout(r, 100))
  assert.ok(shown.includes('33 77'), shown)
  await sb.pty.resize(term.pid, { rows: 40, cols: 100 })
  await sb.pty.sendInput(term.pid, typed.encode('stty size; exit 0\n'))
  assert.equal((await term.wait()).exitCode, 0)
  assert.ok(shown.includes('40 100'), shown)
})

test('list, getInfo and metadata', async () => {
  const sb = await create(Base, { metadata: { ...meta, role: 'listed' } })
  const info = await sb.getInfo()
  assert.deepEqual(info.metadata, { ...meta, role: 'listed' })
  const page = await Base.list({ query: { metadata: { role: 'listed', suite: run } } }).nextItems()
  assert.deepEqual(page.map((s) => s.sandboxId), [sb.sandboxId])
})

test('pause and connect keep state', async () => {
  const sb = await create()
  await sb.runCode("kept = 'yes'")
  await sb.pause()
  assert.equal((await Base.getInfo(sb.sandboxId)).state, 'paused')
  const again = await Sandbox.connect(sb.sandboxId)
  assert.equal((await again.runCode('kept')).text, "'yes'")
})

test('createSnapshot, then create from it; fork', async () => {
  const sb = await create()
  await sb.files.write('/home/user/s.txt', 'snapshotted')
  const snap = await sb.createSnapshot()
  const fromSnap = await Base.create(snap.snapshotId, { metadata: meta })
  made.push(fromSnap)
  assert.equal(await fromSnap.files.read('/home/user/s.txt'), 'snapshotted')
  await sb.runCode('n = 1')
  const forks = await sb.fork({ count: 2 })
  assert.equal(forks.length, 2)
  for (const f of forks) {
    assert.ok(!(f instanceof Error), String(f))
    made.push(f)
    assert.equal((await f.runCode('n + 1')).text, '2')
  }
})

test('setTimeout and expiry; kill', async () => {
  const sb = await create(Base)
  await sb.setTimeout(2000)
  const deadline = Date.now() + 30000
  while (Date.now() < deadline && (await sb.isRunning())) await new Promise((r) => setTimeout(r, 500))
  assert.equal(await sb.isRunning(), false)
  const other = await create(Base)
  assert.equal(await other.kill(), true)
  assert.equal(await Base.kill(other.sandboxId), false)
})

test('a wrong API key is refused', async () => {
  await assert.rejects(Base.create({ apiKey: 'not-the-right-key-at-all' }), AuthenticationError)
})

test('eight concurrent sandboxes', async () => {
  const results = await Promise.all(
    Array.from({ length: 8 }, async (_, i) => {
      const s = await create(Base)
      const r = await s.commands.run(`echo js-${i}`)
      await s.kill()
      return r.stdout.trim()
    }),
  )
  assert.deepEqual(results, Array.from({ length: 8 }, (_, i) => `js-${i}`))
})

test('the dashboard lists a sandbox and its kill button removes it', async (t) => {
  const chromium = '/usr/bin/chromium'
  if (!existsSync(chromium)) {
    t.skip(`skipped: ${chromium} is missing (apt-get install chromium)`)
    return
  }
  const { chromium: launcher } = await import('playwright-core')
  const sb = await create(Base, { metadata: { ...meta, role: 'dashboard' } })
  const browser = await launcher.launch({
    executablePath: chromium,
    args: [
      '--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
      '--disable-background-networking', '--disable-component-update', '--disable-sync',
    ],
  })
  try {
    const page = await browser.newPage()
    await page.goto(`${process.env.CUBE_ADMIN_URL}/#key=${process.env.E2B_API_KEY}`)
    const row = page.locator(`tr[data-sandbox="${sb.sandboxId}"]`)
    await row.waitFor({ timeout: 15000 })
    assert.match(await row.innerText(), /running/)
    await row.locator('button.kill').click()
    await row.waitFor({ state: 'detached', timeout: 15000 })
    assert.equal(await sb.isRunning(), false)
  } finally {
    await browser.close()
  }
})
