// The request options routers and evaluation harnesses bring, from Node: prompt logprobs,
// logit_bias (a map: a plain object), min_tokens, Detokenize, and Abort by request id.

import assert from 'node:assert/strict';
import { after, test } from 'node:test';

import { PieError } from '../../clients/node/pie.mjs';
import { connect, idle, loadOf, waitFor } from './connect.mjs';

const pie = connect();
after(() => pie.close());

const PROMPT = 'the cat sat on the mat';

test('prompt_logprobs: one entry per prompt token, the first without a logprob', async () => {
  const tokens = await pie.tokenize({ text: PROMPT });
  const done = await pie.generate({ prompt: PROMPT, sampling: { max_tokens: 2, prompt_logprobs: 2 } });
  assert.deepEqual(done.prompt_logprobs.map((e) => e.token_id), tokens.token_ids);
  assert.equal(done.prompt_logprobs[0].logprob, undefined); // an unset `optional` field is absent
  assert.deepEqual(done.prompt_logprobs[0].top_logprobs, []);
  for (const entry of done.prompt_logprobs.slice(1)) {
    assert.ok(entry.logprob <= 0 && entry.top_logprobs.length === 2, JSON.stringify(entry));
    assert.ok(entry.top_logprobs[0].logprob >= entry.logprob - 1e-6); // the most likely is at least as likely
  }
  const messages = [];
  for await (const message of pie.stream({ prompt: PROMPT, sampling: { max_tokens: 2, prompt_logprobs: 2 } })) {
    messages.push(message);
  }
  assert.deepEqual(messages[0].prompt_logprobs, done.prompt_logprobs);
  assert.ok(messages.slice(1).every((m) => m.prompt_logprobs.length === 0));
});

test('logit_bias forces a token; min_tokens holds back end-of-sequence', async () => {
  const forced = await pie.generate({ prompt: PROMPT, sampling: { max_tokens: 4, ignore_eos: true,
    logit_bias: { 42: 100 } } });
  assert.deepEqual(forced.token_ids, [42, 42, 42, 42]);
  const [eos] = (await pie.modelInfo()).eos_token_ids;
  const ends = await pie.generate({ prompt: PROMPT, sampling: { max_tokens: 10, min_tokens: 3,
    logit_bias: { [eos]: 100 } } });
  assert.equal(ends.finish_reason, 'FINISH_REASON_STOP');
  assert.equal(ends.token_ids.length, 4);
  assert.equal(ends.token_ids[3], eos);
});

test('Detokenize: the text of Tokenize\'s ids; special tokens kept when asked', async () => {
  const tokens = await pie.tokenize({ text: PROMPT });
  assert.equal((await pie.detokenize({ token_ids: tokens.token_ids })).text, PROMPT);
  const kept = await pie.detokenize({ token_ids: tokens.token_ids, skip_special_tokens: false });
  assert.ok(kept.text.endsWith(PROMPT) && kept.text.length > PROMPT.length, kept.text);
  await assert.rejects(pie.detokenize({ token_ids: [10_000_000] }),
    (error) => error instanceof PieError && error.reason === 'INVALID_FIELD'
      && error.fieldViolations[0].field === 'token_ids');
});

test('Abort: the caller\'s stream ends CANCELLED (REQUEST_ABORTED), its blocks free; again finds nothing', async () => {
  const stream = pie.stream({ prompt: PROMPT, request_id: 'node-abort-1',
    sampling: { max_tokens: 8000, ignore_eos: true } });
  const first = await stream.next();
  assert.equal(first.done, false);
  assert.deepEqual((await pie.abort({ request_ids: ['node-abort-1', 'node-abort-unknown'] })).aborted_request_ids,
    ['node-abort-1']);
  await assert.rejects((async () => { for await (const message of stream) void message; })(),
    (error) => error instanceof PieError && error.codeName === 'CANCELLED' && error.reason === 'REQUEST_ABORTED'
      && error.requestId === 'node-abort-1');
  assert.deepEqual((await pie.abort({ request_ids: ['node-abort-1'] })).aborted_request_ids, []);
  await waitFor(() => loadOf(pie), idle, { what: 'the aborted request\'s blocks back' });
});
