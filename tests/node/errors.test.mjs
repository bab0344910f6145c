// Errors as a Node caller sees them: the gRPC status plus the google.rpc details that pie puts in
// the `grpc-status-details-bin` trailer (ErrorInfo, BadRequest, RetryInfo), decoded by PieError.
// The server runs with --max-num-seqs 1 --max-waiting 1, so that two streams fill it.

import assert from 'node:assert/strict';
import { after, test } from 'node:test';

import { PieError } from '../../clients/node/pie.mjs';
import { connect, idle, loadOf, waitFor } from './connect.mjs';

const pie = connect();
after(() => pie.close());

const load = () => loadOf(pie);

test('temperature -1: INVALID_ARGUMENT, reason INVALID_FIELD, BadRequest names sampling.temperature', async () => {
  const request = { prompt: 'hello', sampling: { temperature: -1 } };
  const error = await pie.generate(request, { metadata: { 'x-request-id': 'node-bad-temperature' } })
    .then(() => assert.fail('accepted'), (e) => e);
  assert.ok(error instanceof PieError, String(error));
  assert.equal(error.codeName, 'INVALID_ARGUMENT');
  assert.equal(error.code, 3);
  assert.equal(error.reason, 'INVALID_FIELD');
  assert.equal(error.domain, 'pie.v1');
  assert.deepEqual(error.fieldViolations.map((v) => v.field), ['sampling.temperature']);
  assert.ok(error.fieldViolations[0].description.length > 0);
  assert.equal(error.retryDelayMs, null);
  assert.equal(error.requestId, 'node-bad-temperature'); // echoed from the x-request-id sent
  assert.match(String(error), /^INVALID_ARGUMENT INVALID_FIELD: sampling\.temperature: .* \[request_id=node-bad-temperature\]$/);
});

test('the same error on a stream arrives while reading it; without an id the server makes one', async () => {
  const messages = pie.stream({ prompt: 'hello', sampling: { temperature: -1 } });
  await assert.rejects(async () => {
    for await (const message of messages) assert.fail(`got a message: ${JSON.stringify(message)}`);
  }, (error) => {
    assert.equal(error.reason, 'INVALID_FIELD');
    assert.deepEqual(error.fieldViolations.map((v) => v.field), ['sampling.temperature']);
    assert.match(error.requestId, /^\S+$/);
    return true;
  });
});

test('an empty prompt: INVALID_FIELD on prompt', async () => {
  await assert.rejects(pie.generate({ prompt: '' }), (error) => {
    assert.equal(error.reason, 'INVALID_FIELD');
    assert.deepEqual(error.fieldViolations.map((v) => v.field), ['prompt']);
    return true;
  });
});

test('prompt_token_ids longer than the context: INVALID_ARGUMENT, reason PROMPT_TOO_LONG', async () => {
  const { max_model_len: context } = await pie.modelInfo();
  const ids = Array.from({ length: context + 1 }, (_, i) => 3 + (i % 100));
  await assert.rejects(pie.generate({ prompt_token_ids: { ids } }), (error) => {
    assert.equal(error.codeName, 'INVALID_ARGUMENT');
    assert.equal(error.reason, 'PROMPT_TOO_LONG');
    assert.equal(error.domain, 'pie.v1');
    assert.equal(error.fieldViolations.length, 1);
    assert.ok(error.fieldViolations[0].field.startsWith('prompt'), error.fieldViolations[0].field);
    assert.ok(error.message.includes(String(ids.length)), error.message);
    return true;
  });
});

test('a full waiting queue: RESOURCE_EXHAUSTED, reason QUEUE_FULL, RetryInfo 1 s', async () => {
  await waitFor(load, idle, { what: 'an idle server' });
  const long = { prompt: 'the cat sat', sampling: { max_tokens: 4000, ignore_eos: true } };
  const running = pie.stream(long);
  let waiting = null;
  try {
    await running.next(); // its first message: it holds the one batch slot
    waiting = pie.stream(long); // submitted on the call's start, read or not
    await waitFor(load, (l) => l.requests_running === 1 && l.requests_waiting === 1, { what: 'one running, one waiting' });
    await assert.rejects(pie.generate({ prompt: 'one too many' }), (error) => {
      assert.equal(error.codeName, 'RESOURCE_EXHAUSTED');
      assert.equal(error.reason, 'QUEUE_FULL');
      assert.equal(error.retryDelayMs, 1000);
      return true;
    });
  } finally {
    running.cancel();
    waiting?.cancel();
  }
  await waitFor(load, idle, { what: 'the server to free both streams' });
});
