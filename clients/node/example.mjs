#!/usr/bin/env node
// Streams a completion from pie to stdout:
//
//   node clients/node/example.mjs [ADDRESS] PROMPT [--max-tokens N] [--temperature T]
//
// ADDRESS defaults to 127.0.0.1:50051. The finish reason and token counts go to stderr; an error
// goes to stderr as one line (status, reason, message, request id) and the exit status is 1.

import { parseArgs } from 'node:util';

import { PieClient, PieError } from './pie.mjs';

const USAGE = 'usage: node example.mjs [ADDRESS] PROMPT [--max-tokens N] [--temperature T]';

function usage(problem) {
  console.error(`${problem ? `${problem}\n` : ''}${USAGE}`);
  process.exit(2);
}

let values, positionals;
try {
  ({ values, positionals } = parseArgs({
    allowPositionals: true,
    options: {
      'max-tokens': { type: 'string', default: '64' },
      temperature: { type: 'string', default: '0.7' }, // a negative value goes as --temperature=-1
    },
  }));
} catch (error) {
  usage(error.message);
}
if (positionals.length < 1 || positionals.length > 2) usage();
const [address, prompt] = positionals.length === 2 ? positionals : ['127.0.0.1:50051', positionals[0]];
const sampling = { max_tokens: Number(values['max-tokens']), temperature: Number(values.temperature) };

const pie = new PieClient(address);
try {
  let last = null;
  for await (const message of pie.stream({ prompt, sampling })) {
    process.stdout.write(message.text);
    last = message;
  }
  process.stdout.write('\n');
  const { prompt_tokens: read, completion_tokens: written } = last.usage;
  console.error(`[${last.finish_reason}: ${read} prompt tokens, ${written} generated; request ${last.request_id}]`);
} catch (error) {
  if (!(error instanceof PieError)) throw error;
  console.error(`pie: ${error}`);
  process.exitCode = 1;
} finally {
  pie.close();
}
