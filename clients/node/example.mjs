#!/usr/bin/env node
// Streams a completion from pie to stdout:
//
//   node clients/node/example.mjs [ADDRESS] PROMPT [--max-tokens N] [--temperature T]
//
// ADDRESS defaults to 127.0.0.1:50051. The finish reason and token counts go to stderr; an error
// goes to stderr as one line (status, reason, message, request id) and the exit status is 1. A
// value the request cannot carry (--max-tokens abc, 0, -3 or past uint32; --temperature abc) is
// refused before anything is sent, in one line, with exit status 2; values the wire can carry
// (a negative temperature) are the server's to refuse, as any client's would be.

import { parseArgs } from 'node:util';

import { PieClient, PieError } from './pie.mjs';

const HELP = `usage: node example.mjs [ADDRESS] PROMPT [--max-tokens N] [--temperature T]

Streams a completion from a pie server to stdout; the finish reason and token counts go to stderr.

  ADDRESS           the server's host:port (default: 127.0.0.1:50051)
  PROMPT            the prompt text
  --max-tokens N    most tokens to generate, a whole number in 1..4294967295 (default: 64)
  --temperature T   softmax temperature; 0 is greedy decoding (default: 0.7; a negative value
                    goes as --temperature=-1, and the server refuses it)
  -h, --help        print this help and exit

Exit status: 0 done; 1 the server answered with an error (one line on stderr); 2 a usage error.`;

const UINT32_MAX = 2 ** 32 - 1; // max_tokens is a uint32: -3 would arrive as 4294967293
const FLOAT32_MAX = 3.4028234663852886e38; // temperature is a float: larger arrives as infinity

function usage(problem) {
  const line = problem.replace(/\s*\n\s*/g, ' '); // parseArgs' messages run over several lines
  console.error(`example.mjs: error: ${line} (node example.mjs --help shows the usage)`);
  process.exit(2);
}

// A whole number in [min, max] written in decimal digits (Number() would take '', '0x10', '1e3').
function wholeNumber(flag, text, min, max) {
  const value = /^[0-9]+$/.test(text) ? Number(text) : NaN;
  if (!(value >= min && value <= max)) usage(`${flag} must be a whole number in ${min}..${max}, got ${JSON.stringify(text)}`);
  return value;
}

function float32(flag, text) {
  const value = text.trim() === '' ? NaN : Number(text);
  if (!Number.isFinite(value)) usage(`${flag} must be a number, got ${JSON.stringify(text)}`);
  if (Math.abs(value) > FLOAT32_MAX) usage(`${flag} must fit a 32-bit float (magnitude below 3.4e38), got ${text}`);
  return value;
}

let values, positionals;
try {
  ({ values, positionals } = parseArgs({
    allowPositionals: true,
    options: {
      'max-tokens': { type: 'string', default: '64' },
      temperature: { type: 'string', default: '0.7' },
      help: { type: 'boolean', short: 'h', default: false },
    },
  }));
} catch (error) {
  usage(error.message);
}
if (values.help) {
  console.log(HELP);
  process.exit(0);
}
if (positionals.length < 1) usage('give the PROMPT (and, before it, the ADDRESS if not 127.0.0.1:50051)');
if (positionals.length > 2) usage(`expected [ADDRESS] PROMPT, got ${positionals.length} arguments (quote a prompt with spaces)`);
const [address, prompt] = positionals.length === 2 ? positionals : ['127.0.0.1:50051', positionals[0]];
const sampling = {
  max_tokens: wholeNumber('--max-tokens', values['max-tokens'], 1, UINT32_MAX),
  temperature: float32('--temperature', values.temperature),
};

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
