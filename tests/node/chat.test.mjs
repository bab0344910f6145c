// Chats and structured output from Node through clients/node/pie.mjs: the conversation rendered
// with the model's template (a ChatML model), constraints that hold at temperature 1, and the
// errors that name the field.

import assert from 'node:assert/strict';
import { after, test } from 'node:test';

import { PieError, chatRequest } from '../../clients/node/pie.mjs';
import { connect } from './connect.mjs';

const pie = connect();
after(() => pie.close());

const MESSAGES = [{ role: 'system', content: 'Be brief.' }, { role: 'user', content: 'Weather in Paris?' }];
const SCHEMA = {
  type: 'object',
  properties: { city: { type: 'string', maxLength: 10 }, sky: { enum: ['clear', 'rain'] }, degrees: { type: 'integer', minimum: -20, maximum: 40 } },
  required: ['city', 'sky', 'degrees'],
  additionalProperties: false,
};

test('chatRequest builds the ChatInput: optional fields left out, tool calls and tools as JSON', () => {
  const request = chatRequest([{ role: 'user', content: 'x', name: null },
    { role: 'assistant', tool_calls: [{ type: 'function', function: { name: 'f', arguments: {} } }] }],
  { tools: [{ type: 'function' }], templateKwargs: { enable_thinking: false }, sampling: { max_tokens: 3 } });
  assert.deepEqual(request.chat.messages[0], { role: 'user', content: 'x' });
  assert.deepEqual(JSON.parse(request.chat.messages[1].tool_calls_json), [{ type: 'function', function: { name: 'f', arguments: {} } }]);
  assert.equal(request.chat.tools_json, '[{"type":"function"}]');
  assert.equal(request.chat.template_kwargs_json, '{"enable_thinking":false}');
  assert.equal('add_generation_prompt' in request.chat, false);
  assert.deepEqual(request.sampling, { max_tokens: 3 });
  assert.throws(() => chatRequest('hello'), TypeError);
});

test('tokenizeChat: the rendered conversation and its ids; chat generates from exactly them', async () => {
  const rendered = await pie.tokenizeChat(MESSAGES);
  assert.ok(rendered.rendered_text.startsWith('<|im_start|>system\nBe brief.<|im_end|>'), rendered.rendered_text);
  assert.ok(rendered.rendered_text.endsWith('<|im_start|>assistant\n'));
  const done = await pie.chat(MESSAGES, { sampling: { max_tokens: 4, temperature: 0, ignore_eos: true } });
  assert.equal(done.usage.prompt_tokens, rendered.count);
  const same = await pie.generate({ prompt_token_ids: { ids: rendered.token_ids }, sampling: { max_tokens: 4, temperature: 0, ignore_eos: true } });
  assert.deepEqual(done.token_ids, same.token_ids);
  const streamed = [];
  for await (const message of pie.chatStream(MESSAGES, { sampling: { max_tokens: 4, temperature: 0, ignore_eos: true } })) {
    streamed.push(...message.token_ids);
  }
  assert.deepEqual(streamed, done.token_ids);
});

test('structured output: seeded samples at temperature 1 parse and validate; choices and regexes hold', async () => {
  for (let seed = 0; seed < 4; seed += 1) {
    const done = await pie.chat(MESSAGES, { sampling: { max_tokens: 200, temperature: 1, seed, structured: { json_schema: JSON.stringify(SCHEMA) } } });
    assert.equal(done.finish_reason, 'FINISH_REASON_STOP', done.text);
    const value = JSON.parse(done.text);
    assert.deepEqual(Object.keys(value).sort(), ['city', 'degrees', 'sky']);
    assert.ok(['clear', 'rain'].includes(value.sky) && Number.isInteger(value.degrees) && value.degrees >= -20 && value.degrees <= 40);
    assert.ok([...value.city].length <= 10, value.city); // maxLength counts code points
    const picked = await pie.generate({ prompt: 'x', sampling: { temperature: 1, seed, structured: { choice: { choices: ['yes', 'no'] } } } });
    assert.ok(['yes', 'no'].includes(picked.text), picked.text);
    const date = await pie.generate({ prompt: 'x', sampling: { max_tokens: 20, temperature: 1, seed, structured: { regex: '20[0-9]{2}-0[1-9]' } } });
    assert.match(date.text, /^20[0-9]{2}-0[1-9]$/);
  }
});

test('errors name the field: a regex that does not compile, an empty role', async () => {
  await assert.rejects(pie.generate({ prompt: 'x', sampling: { structured: { regex: '(unclosed' } } }), (error) => {
    assert.ok(error instanceof PieError);
    assert.equal(error.codeName, 'INVALID_ARGUMENT');
    assert.equal(error.reason, 'INVALID_FIELD');
    assert.equal(error.fieldViolations[0].field, 'sampling.structured.regex');
    assert.match(error.fieldViolations[0].description, /unclosed group/);
    return true;
  });
  await assert.rejects(pie.chat([{ role: '', content: 'x' }]), (error) => {
    assert.equal(error.fieldViolations[0].field, 'chat.messages[0].role');
    return true;
  });
});
