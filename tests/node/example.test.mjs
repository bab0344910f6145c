// clients/node/example.mjs run as a user would run it: it streams the text to stdout, and says an
// error in one line on stderr with exit status 1.

import assert from 'node:assert/strict';
import { execFile } from 'node:child_process';
import { cp, mkdtemp, readdir, readFile, rm, symlink, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { promisify } from 'node:util';
import { after, test } from 'node:test';

import { ADDRESS, connect } from './connect.mjs';

const EXAMPLE = fileURLToPath(new URL('../../clients/node/example.mjs', import.meta.url));
const run = promisify(execFile);

const pie = connect();
after(() => pie.close());

async function example(...args) {
  try {
    const { stdout, stderr } = await run(process.execPath, [EXAMPLE, ...args], { timeout: 30_000 });
    return { code: 0, stdout, stderr };
  } catch (error) {
    if (typeof error.code !== 'number') throw error; // it did not run, or timed out
    return { code: error.code, stdout: error.stdout, stderr: error.stderr };
  }
}

test('example.mjs prints the streamed completion, the same text as Generate\'s', async () => {
  const prompt = 'the old house near the river';
  const out = await example(ADDRESS, prompt, '--max-tokens', '24', '--temperature', '0');
  assert.equal(out.code, 0, out.stderr);
  const expected = await pie.generate({ prompt, sampling: { max_tokens: 24, temperature: 0 } });
  assert.equal(out.stdout, `${expected.text}\n`);
  const generated = expected.usage.completion_tokens;
  assert.match(out.stderr, new RegExp(`^\\[${expected.finish_reason}: \\d+ prompt tokens, ${generated} generated; request \\S+\\]\\n$`));
});

test('example.mjs reports a bad request on stderr in one line and exits 1', async () => {
  const out = await example(ADDRESS, 'hello', '--temperature=-1');
  assert.equal(out.code, 1, out.stderr);
  assert.equal(out.stdout, '');
  assert.match(out.stderr, /^pie: INVALID_ARGUMENT INVALID_FIELD: sampling\.temperature: .* \[request_id=\S+\]\n$/);
});

test('the docs\' Node snippet runs as written, from a folder of its own with the files it says to copy', async () => {
  const root = fileURLToPath(new URL('../../', import.meta.url));
  // README.md and docs/*.md, as tests/doc_files.py reads them: the snippet may sit in any of them
  const docs = ['README.md', ...(await readdir(path.join(root, 'docs'))).filter((f) => f.endsWith('.md')).sort()
    .map((f) => path.join('docs', f))];
  const texts = await Promise.all(docs.map((doc) => readFile(path.join(root, doc), 'utf8')));
  const snippets = texts.flatMap((text) => [...text.matchAll(/^```js\n(.*?)^```/gms)].map((m) => m[1]));
  assert.equal(snippets.length, 1, `one js block in ${docs.join(', ')}`);
  assert.ok(snippets[0].includes("'pie.internal:50051'"), snippets[0]);

  const folder = await mkdtemp(path.join(tmpdir(), 'pie-node-'));
  try {
    await cp(path.join(root, 'clients/node/pie.mjs'), path.join(folder, 'pie.mjs'));
    await cp(path.join(root, 'clients/node/protos'), path.join(folder, 'protos'), { recursive: true });
    await cp(path.join(root, 'protos/pie/v1/generate.proto'), path.join(folder, 'generate.proto'));
    await symlink(path.join(root, 'node_modules'), path.join(folder, 'node_modules')); // `npm install`, already done
    await writeFile(path.join(folder, 'snippet.mjs'), snippets[0].replace("'pie.internal:50051'", `'${ADDRESS}'`));
    const { stdout } = await run(process.execPath, ['snippet.mjs'], { cwd: folder, timeout: 30_000 });
    assert.match(stdout, /FINISH_REASON_(LENGTH|STOP) \{/);
    assert.ok(stdout.length > 40, stdout);
  } finally {
    await rm(folder, { recursive: true, force: true });
  }
});
