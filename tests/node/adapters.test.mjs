// LoRA adapters from Node: the server (tests/clients/test_node_client.py) starts with one adapter,
// `node-lora` (PIE_ADAPTER_DIR: its folder, a random PEFT adapter of rank 8), and two GPU slots.

import assert from 'node:assert/strict';
import { after, test } from 'node:test';

import { PieError } from '../../clients/node/pie.mjs';
import { connect } from './connect.mjs';

const pie = connect();
after(() => pie.close());

const ADAPTER_DIR = process.env.PIE_ADAPTER_DIR;
const PROMPT = 'the cat sat on the mat';
const GREEDY = { max_tokens: 12, temperature: 0, ignore_eos: true };

const names = async () => (await pie.listAdapters()).adapters.map((a) => a.name).sort();

test('ListAdapters: the adapter loaded at start, the slots and the rank limit', async () => {
  const listed = await pie.listAdapters();
  assert.equal(listed.max_loras, 2);
  assert.equal(listed.max_lora_rank, 16);
  const adapter = listed.adapters.find((a) => a.name === 'node-lora');
  assert.ok(adapter, JSON.stringify(listed));
  assert.equal(adapter.rank, 8);
  assert.equal(adapter.path, ADAPTER_DIR);
});

test('a request on the adapter answers otherwise than the base model, and alike under a second name', async () => {
  assert.ok(ADAPTER_DIR, 'PIE_ADAPTER_DIR is not set');
  const base = await pie.generate({ prompt: PROMPT, sampling: GREEDY });
  const tuned = await pie.generate({ prompt: PROMPT, sampling: GREEDY, adapter: 'node-lora' });
  assert.notDeepEqual(tuned.token_ids, base.token_ids);

  const loaded = await pie.loadAdapter({ name: 'node-lora-again', path: ADAPTER_DIR });
  assert.equal(loaded.adapter.name, 'node-lora-again');
  assert.equal(loaded.adapter.rank, 8);
  assert.deepEqual(await names(), ['node-lora', 'node-lora-again']);
  const again = [];
  for await (const message of pie.stream({ prompt: PROMPT, sampling: GREEDY, adapter: 'node-lora-again' })) {
    again.push(...message.token_ids);
  }
  assert.deepEqual(again, tuned.token_ids); // the same weights under another name: the same answer

  await pie.unloadAdapter({ name: 'node-lora-again' });
  assert.deepEqual(await names(), ['node-lora']);
  await assert.rejects(pie.generate({ prompt: PROMPT, sampling: GREEDY, adapter: 'node-lora-again' }), (error) => {
    assert.ok(error instanceof PieError, String(error));
    assert.equal(error.codeName, 'NOT_FOUND');
    assert.equal(error.reason, 'ADAPTER_NOT_FOUND');
    assert.match(error.message, /node-lora-again/);
    return true;
  });
});

test('an unknown adapter on a stream: NOT_FOUND naming it, while reading', async () => {
  await assert.rejects(async () => {
    for await (const message of pie.stream({ prompt: PROMPT, adapter: 'no-such-lora' })) {
      assert.fail(`got a message: ${JSON.stringify(message)}`);
    }
  }, (error) => {
    assert.equal(error.codeName, 'NOT_FOUND');
    assert.equal(error.reason, 'ADAPTER_NOT_FOUND');
    assert.match(error.message, /no-such-lora/);
    return true;
  });
});

test('LoadAdapter: a folder without an adapter, or a name in use, is INVALID_ARGUMENT naming it', async () => {
  await assert.rejects(pie.loadAdapter({ name: 'empty', path: '/nonexistent/adapter' }), (error) => {
    assert.equal(error.codeName, 'INVALID_ARGUMENT');
    assert.equal(error.reason, 'ADAPTER_INVALID');
    assert.match(error.message, /empty/);
    return true;
  });
  await assert.rejects(pie.loadAdapter({ name: 'node-lora', path: ADAPTER_DIR }), (error) => {
    assert.equal(error.reason, 'ADAPTER_INVALID');
    assert.match(error.message, /node-lora/);
    return true;
  });
  assert.deepEqual(await names(), ['node-lora']);
});
