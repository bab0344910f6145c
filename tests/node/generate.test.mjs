// The four RPCs of pie.v1.GenerateService and the health service, called from Node through
// clients/node/pie.mjs against a live `pie serve` (a tiny random model on the CPU).

import assert from 'node:assert/strict';
import { after, test } from 'node:test';

import { connect } from './connect.mjs';

const pie = connect();
after(() => pie.close());

const PROMPT = 'the cat sat on the mat';
// Greedy and past end-of-sequence: the same MAX_TOKENS tokens whichever RPC asks for them.
const MAX_TOKENS = 12;
const GREEDY = { max_tokens: MAX_TOKENS, temperature: 0, ignore_eos: true };

function counts(usage) {
  const { prompt_tokens, completion_tokens, total_tokens } = usage;
  return { prompt_tokens, completion_tokens, total_tokens };
}

test('Generate: text, token ids, finish reason, usage and the caller\'s request id', async () => {
  const prompt = await pie.tokenize({ text: PROMPT });
  const done = await pie.generate({ prompt: PROMPT, sampling: GREEDY, request_id: 'node-generate' });
  assert.equal(done.request_id, 'node-generate');
  assert.equal(typeof done.text, 'string');
  assert.equal(done.token_ids.length, MAX_TOKENS);
  assert.equal(done.finish_reason, 'FINISH_REASON_LENGTH');
  assert.equal(done.stop_reason, '');
  assert.deepEqual(counts(done.usage),
    { prompt_tokens: prompt.count, completion_tokens: MAX_TOKENS, total_tokens: prompt.count + MAX_TOKENS });
  assert.deepEqual(done.choices, []); // n = 1
});

test('Generate: a stop token id ends it with FINISH_REASON_STOP and names the token', async () => {
  const full = await pie.generate({ prompt: PROMPT, sampling: GREEDY });
  const stopId = full.token_ids[4];
  const stopped = await pie.generate({ prompt: PROMPT, sampling: { ...GREEDY, stop_token_ids: [stopId] } });
  assert.equal(stopped.finish_reason, 'FINISH_REASON_STOP');
  assert.equal(stopped.stop_reason, String(stopId));
  const before = full.token_ids.indexOf(stopId); // its first appearance ends generation
  assert.deepEqual(stopped.token_ids.slice(0, before), full.token_ids.slice(0, before));
  assert.ok(stopped.usage.completion_tokens <= before + 1, JSON.stringify(stopped));
});

test('GenerateStream: the deltas add up to the greedy Generate answer; the last message ends it', async () => {
  const unary = await pie.generate({ prompt: PROMPT, sampling: GREEDY });
  const messages = [];
  for await (const message of pie.stream({ prompt: PROMPT, sampling: GREEDY })) messages.push(message);

  // The server coalesces what arrived before it writes: a busy machine may get the whole answer in one message.
  assert.ok(messages.length >= 1, `${messages.length} messages`);
  for (const message of messages.slice(0, -1)) {
    assert.equal(message.finish_reason, 'FINISH_REASON_UNSPECIFIED');
    assert.equal(message.usage, null); // usage rides on the last message only
  }
  const last = messages.at(-1);
  assert.equal(last.finish_reason, 'FINISH_REASON_LENGTH');
  assert.deepEqual(counts(last.usage), counts(unary.usage));
  assert.equal(messages.map((m) => m.text).join(''), unary.text);
  assert.deepEqual(messages.flatMap((m) => m.token_ids), unary.token_ids);
  assert.deepEqual([...new Set(messages.map((m) => m.request_id))], [messages[0].request_id]);
  assert.ok(messages.every((m) => m.index === 0));
});

test('Tokenize: ids, their text pieces and the count; add_special_tokens=false drops BOS', async () => {
  const info = await pie.modelInfo();
  const tokens = await pie.tokenize({ text: PROMPT });
  assert.equal(tokens.count, tokens.token_ids.length);
  assert.equal(tokens.tokens.length, tokens.count);
  assert.equal(tokens.token_ids[0], info.bos_token_id);
  assert.ok(tokens.tokens.every((piece) => typeof piece === 'string' && piece.length > 0));
  // proto3 `optional bool`: false is sent as set, not taken for unset (which means true).
  const bare = await pie.tokenize({ text: PROMPT, add_special_tokens: false });
  assert.deepEqual(bare.token_ids, tokens.token_ids.slice(1));
});

test('GetModelInfo: the model\'s fields and the load, every count a number', async () => {
  const info = await pie.modelInfo();
  for (const key of ['model_name', 'architecture', 'model_type', 'kv_cache_dtype', 'device', 'dtype']) {
    assert.equal(typeof info[key], 'string', key);
    assert.ok(info[key].length > 0, key);
  }
  assert.equal(info.model_type, 'llama');
  assert.equal(info.device, 'cpu');
  assert.equal(info.kv_cache_dtype, 'fp32');
  for (const key of ['max_model_len', 'vocab_size', 'block_size', 'bos_token_id']) {
    assert.ok(Number.isInteger(info[key]) && info[key] >= 0, `${key}: ${info[key]}`);
  }
  assert.ok(info.eos_token_ids.length > 0 && info.eos_token_ids.every(Number.isInteger));
  const load = info.load;
  for (const key of ['kv_blocks_total', 'kv_blocks_free', 'kv_blocks_cached', 'requests_running',
    'requests_waiting', 'max_num_seqs', 'max_waiting']) {
    assert.equal(typeof load[key], 'number', key);
  }
  assert.ok(load.kv_blocks_total > 0 && load.kv_blocks_free <= load.kv_blocks_total);
  assert.ok(load.kv_blocks_cached <= load.kv_blocks_free);
});

test('health: "" (liveness) and pie.v1.GenerateService (readiness) are SERVING; an unknown name is NOT_FOUND', async () => {
  assert.equal(await pie.check(''), 'SERVING');
  assert.equal(await pie.check('pie.v1.GenerateService'), 'SERVING');
  await assert.rejects(pie.check('pie.v1.NoSuchService'), { codeName: 'NOT_FOUND', reason: null });
});
