// A caller that cancels a stream mid-way: the server aborts the request and frees its KV blocks.
// The server's context (16k tokens) makes the stream below run for tens of seconds if nothing
// stops it, so the wait for an idle server cannot be met by the request running out.
// tests/clients/test_node_client.py also finds this request (REQUEST_ID) in the server's log, ended
// CANCELLED.

import assert from 'node:assert/strict';
import { after, test } from 'node:test';

import { PieError } from '../../clients/node/pie.mjs';
import { connect, idle, loadOf, waitFor } from './connect.mjs';

const REQUEST_ID = 'node-cancelled-stream';
const FREED_WITHIN_MS = 5_000;

const pie = connect();
after(() => pie.close());

const load = () => loadOf(pie);

test('cancel mid-stream: CANCELLED for the caller, the request aborted and its blocks freed', async () => {
  const { max_model_len: context } = await pie.modelInfo();
  await waitFor(load, idle, { what: 'an idle server' });
  const maxTokens = context - 64;
  const stream = pie.stream({ prompt: 'the cat sat', sampling: { max_tokens: maxTokens, ignore_eos: true },
    request_id: REQUEST_ID });

  const first = await stream.next();
  assert.equal(first.value.finish_reason, 'FINISH_REASON_UNSPECIFIED');
  const busy = await load();
  assert.equal(busy.requests_running, 1, JSON.stringify(busy));
  assert.ok(busy.kv_blocks_free < busy.kv_blocks_total, JSON.stringify(busy));

  stream.cancel();
  let received = 1;
  await assert.rejects(async () => {
    while (!(await stream.next()).done) received += 1;
  }, (error) => error instanceof PieError && error.codeName === 'CANCELLED' && error.reason === null);
  assert.ok(received < maxTokens, `${received} messages`);

  const freed = await waitFor(load, idle, { timeoutMs: FREED_WITHIN_MS, what: 'the server to free the cancelled request' });
  assert.equal(freed.kv_blocks_free, freed.kv_blocks_total);
});
