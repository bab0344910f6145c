// Calling pie from Node.js: the contract (protos/pie/v1/generate.proto) loaded at run time with
// @grpc/proto-loader, a promise or async-iterator helper per RPC over @grpc/grpc-js, and PieError,
// which reads the google.rpc.Status that pie puts in the `grpc-status-details-bin` trailer.
//
//   const pie = new PieClient('127.0.0.1:50051');
//   const done = await pie.generate({ prompt: 'Hello', sampling: { max_tokens: 32 } });
//   for await (const message of pie.stream({ prompt: 'Hello' })) process.stdout.write(message.text);
//
// Messages are plain objects with the .proto's field names (snake_case) and enum names as strings
// ('FINISH_REASON_STOP'); unset scalar fields read as their proto3 defaults (0, '', []), and an
// unset `optional` one is absent (PromptLogprob.logprob of the first prompt token). A map field is
// an object: sampling: { logit_bias: { 13: -100 } }.
//
// LoRA adapters (a server started with --lora NAME=DIR, or loaded at run time):
//   await pie.loadAdapter({ name: 'support', path: '/models/support-lora' });
//   const tuned = await pie.generate({ prompt: 'Hello', adapter: 'support' });
//
// Chats and structured output:
//   const answer = await pie.chat([{ role: 'user', content: 'Name a color.' }],
//     { sampling: { max_tokens: 16, structured: { choice: { choices: ['red', 'green'] } } } });
//   // structured: { json_schema: JSON.stringify(schema) } | { regex } | { choice: { choices } } |
//   //             { grammar } (Lark) | { json_object: true }, on every call's `sampling`

import path from 'node:path';
import { fileURLToPath } from 'node:url';

import * as grpc from '@grpc/grpc-js';
import * as protoLoader from '@grpc/proto-loader';
import protobuf from 'protobufjs';

const HERE = path.dirname(fileURLToPath(import.meta.url));
// The contract as shipped in this repository; pass `protoPath` when the file lives elsewhere.
export const DEFAULT_PROTO = path.resolve(HERE, '../../protos/pie/v1/generate.proto');
// google.rpc error details and grpc.health.v1, written for this client (see protos/ here).
const OWN_PROTOS = path.join(HERE, 'protos');

const LOADER_OPTIONS = {
  keepCase: true, // field names as in the .proto: max_tokens, finish_reason
  enums: String, // enum values as their names
  longs: Number, // uint64 seed: JavaScript numbers (exact below 2^53)
  defaults: true, // unset fields of a response read as 0, '' or [] instead of undefined
};

// The google.rpc messages PieError decodes, by their full name (the end of an Any's type_url).
const rpcTypes = (() => {
  const root = new protobuf.Root();
  root.loadSync([path.join(OWN_PROTOS, 'google/rpc/status.proto'),
    path.join(OWN_PROTOS, 'google/rpc/error_details.proto')], { keepCase: true });
  return Object.fromEntries(['Status', 'ErrorInfo', 'BadRequest', 'RetryInfo']
    .map((name) => [`google.rpc.${name}`, root.lookupType(`google.rpc.${name}`)]));
})();

const COMPRESSION = { none: grpc.compressionAlgorithms.identity, gzip: grpc.compressionAlgorithms.gzip };

// gRPC's retry policy (gRFC A6), the Python client's (pie_client/_channel.py): a call that ends
// UNAVAILABLE before the server sent anything back (a replica down, loading or draining; a
// balancer with no replica to give it) is sent again, up to 4 attempts in all, after random pauses
// of up to 0.1, 0.2 and 0.4 s. The call's deadline covers every attempt. gRPC never replays a call
// whose response headers arrived: pie sends a stream's once it admits it, and a unary call's with
// its answer.
export const RETRY_POLICY = Object.freeze({
  maxAttempts: 4,
  initialBackoff: '0.1s',
  maxBackoff: '1s',
  backoffMultiplier: 2,
  retryableStatusCodes: ['UNAVAILABLE'],
});

/** The channel's service config (JSON) holding RETRY_POLICY for every method of the service. */
export function serviceConfig() {
  return JSON.stringify({ methodConfig: [{ name: [{ service: 'pie.v1.GenerateService' }], retryPolicy: RETRY_POLICY }] });
}

const services = new Map(); // protoPath -> { GenerateService, Health } client constructors

function loadServices(protoPath) {
  if (!services.has(protoPath)) {
    const pie = grpc.loadPackageDefinition(protoLoader.loadSync(protoPath, LOADER_OPTIONS));
    const health = grpc.loadPackageDefinition(
      protoLoader.loadSync(path.join(OWN_PROTOS, 'grpc/health/v1/health.proto'), LOADER_OPTIONS));
    services.set(protoPath, { GenerateService: pie.pie.v1.GenerateService, Health: health.grpc.health.v1.Health });
  }
  return services.get(protoPath);
}

/** A failed call: the gRPC status plus what pie's google.rpc.Status details say about it. */
export class PieError extends Error {
  constructor(serviceError) {
    super(serviceError.details ?? '', { cause: serviceError }); // the status message alone
    this.name = 'PieError';
    this.code = serviceError.code; // grpc.status number, e.g. 3 (INVALID_ARGUMENT)
    this.codeName = grpc.status[serviceError.code] ?? String(serviceError.code);
    this.reason = null; // ErrorInfo.reason, e.g. 'INVALID_FIELD'; null for gRPC's own errors (cancel, deadline)
    this.domain = null; // ErrorInfo.domain: 'pie.v1'
    this.fieldViolations = []; // BadRequest: [{ field: 'sampling.temperature', description }]
    this.retryDelayMs = null; // RetryInfo.retry_delay in milliseconds, where a retry makes sense
    const metadata = serviceError.metadata;
    this.requestId = metadata?.get('x-request-id')[0] ?? null; // the id the server logged this call under
    const details = metadata?.get('grpc-status-details-bin')[0];
    if (details) {
      this.#read(rpcTypes['google.rpc.Status'].decode(details));
    }
  }

  #read(status) {
    for (const any of status.details) {
      const type = rpcTypes[any.type_url.slice(any.type_url.lastIndexOf('/') + 1)];
      if (!type) continue; // a detail this client does not know: skipped, as the contract allows
      const detail = type.toObject(type.decode(any.value), { longs: Number, defaults: true });
      if (type.name === 'ErrorInfo') {
        this.reason = detail.reason;
        this.domain = detail.domain;
      } else if (type.name === 'BadRequest') {
        this.fieldViolations = detail.field_violations.map(({ field, description }) => ({ field, description }));
      } else if (type.name === 'RetryInfo') {
        const { seconds = 0, nanos = 0 } = detail.retry_delay ?? {};
        this.retryDelayMs = seconds * 1000 + nanos / 1e6;
      }
    }
  }

  /** One line: `INVALID_ARGUMENT INVALID_FIELD: sampling.temperature: ... [request_id=...]`. */
  toString() {
    const retry = this.retryDelayMs === null ? '' : ` (retry in ${this.retryDelayMs / 1000} s)`;
    const id = this.requestId === null ? '' : ` [request_id=${this.requestId}]`;
    return `${this.codeName}${this.reason ? ` ${this.reason}` : ''}${this.message ? `: ${this.message}` : ''}${retry}${id}`;
  }
}

/** A @grpc/grpc-js error as a PieError; anything else (a bug, not a call's status) as it is. */
export function decodeError(error) {
  return typeof error?.code === 'number' && 'metadata' in error ? new PieError(error) : error;
}

function chatMessage(message, index) {
  if (message === null || typeof message !== 'object') throw new TypeError(`messages[${index}] must be an object`);
  const { tool_calls: toolCalls, ...fields } = message;
  // Unset optional fields are left out (proto3 presence): null and undefined mean "not set".
  const out = Object.fromEntries(Object.entries(fields).filter(([, value]) => value !== null && value !== undefined));
  if (toolCalls !== null && toolCalls !== undefined) {
    out.tool_calls_json = typeof toolCalls === 'string' ? toolCalls : JSON.stringify(toolCalls);
  }
  return out;
}

/**
 * The request of a conversation: `messages` as [{ role, content, name, tool_call_id, reasoning_content,
 * tool_calls }]
 * (tool_calls an array of tool calls, sent as JSON), `tools` (an array of tool definitions, sent as
 * JSON), `addGenerationPrompt` (default: the server's, true unless continuing),
 * `continueFinalMessage`, `templateKwargs` (more template variables), and the rest of a
 * GenerateRequest (`sampling`, `request_id`) as they are.
 */
export function chatRequest(messages, { tools, addGenerationPrompt, continueFinalMessage = false, templateKwargs,
  ...rest } = {}) {
  if (!Array.isArray(messages)) throw new TypeError('messages must be an array of { role, content, ... }');
  const chat = { messages: messages.map(chatMessage), continue_final_message: continueFinalMessage };
  if (tools !== undefined) chat.tools_json = typeof tools === 'string' ? tools : JSON.stringify(tools);
  if (addGenerationPrompt !== undefined) chat.add_generation_prompt = addGenerationPrompt;
  if (templateKwargs !== undefined) chat.template_kwargs_json = JSON.stringify(templateKwargs);
  return { ...rest, chat };
}

function callArgs({ metadata = {}, timeoutMs } = {}) {
  const md = new grpc.Metadata();
  for (const [key, value] of Object.entries(metadata)) md.set(key, value);
  return [md, timeoutMs === undefined ? {} : { deadline: Date.now() + timeoutMs }];
}

/**
 * A connection to one pie server. Every helper takes the request as a plain object and, last,
 * `{ metadata: { 'x-request-id': 'abc' }, timeoutMs: 30000 }` (both optional).
 */
export class PieClient {
  /**
   * @param {string} address host:port
   * @param {object} [options]
   * @param {string} [options.protoPath] generate.proto to load (default: this repository's)
   * @param {'none'|'gzip'} [options.compression] compress requests (the server accepts gzip)
   * @param {grpc.ChannelCredentials} [options.credentials] default: plaintext
   * @param {object} [options.channelOptions] more grpc-js channel options (a 'grpc.service_config'
   *   of the caller's takes the place of the retry policy's)
   * @param {boolean} [options.retry] retry a call that fails UNAVAILABLE before the server answered
   *   (RETRY_POLICY; default: true)
   */
  constructor(address, { protoPath = DEFAULT_PROTO, compression = 'none', credentials, channelOptions = {},
    retry = true } = {}) {
    const { GenerateService, Health } = loadServices(protoPath);
    if (!Object.hasOwn(COMPRESSION, compression)) {
      throw new TypeError(`compression must be 'none' or 'gzip', got ${compression}`);
    }
    const creds = credentials ?? grpc.credentials.createInsecure();
    const options = { ...(retry ? { 'grpc.service_config': serviceConfig() } : {}), ...channelOptions,
      'grpc.default_compression_algorithm': COMPRESSION[compression] };
    this.service = new GenerateService(address, creds, options);
    this.health = new Health(address, creds, { channelOverride: this.service.getChannel() });
  }

  #unary(client, method, request, options) {
    return new Promise((resolve, reject) => {
      client[method](request, ...callArgs(options), (error, response) => {
        if (error) reject(decodeError(error));
        else resolve(response);
      });
    });
  }

  /** Generate: the whole completion (GenerateResponse). */
  generate(request, options) {
    return this.#unary(this.service, 'Generate', request, options);
  }

  /**
   * GenerateStream: an async iterator of GenerateStreamResponse messages (text deltas; the last
   * one carries finish_reason and usage). `cancel()` ends the call; leaving a for-await loop
   * early cancels it too, and either way the server frees the request.
   */
  stream(request, options) {
    const call = this.service.GenerateStream(request, ...callArgs(options));
    // grpc-js emits a failed status as an 'error' event: without a listener one that comes
    // before the caller starts reading would crash the process, and the reading would not see it.
    let failed = null;
    call.on('error', (error) => { failed ??= error; });
    async function* messages() {
      try {
        for await (const message of call) yield message;
        if (failed) throw failed;
      } catch (error) {
        throw decodeError(error);
      } finally {
        call.cancel(); // nothing to do when the stream already ended
      }
    }
    const iterator = messages();
    iterator.cancel = () => call.cancel();
    return iterator;
  }

  /** Tokenize: { token_ids, tokens, count } (and rendered_text for a `chat`). */
  tokenize(request, options) {
    return this.#unary(this.service, 'Tokenize', request, options);
  }

  /** Detokenize: { text } of { token_ids, skip_special_tokens } (the inverse of Tokenize). */
  detokenize(request, options) {
    return this.#unary(this.service, 'Detokenize', request, options);
  }

  /**
   * Abort: ends this caller's in-flight Generate/GenerateStream calls by the request ids they were
   * given ({ request_ids: ['job-17'] }); resolves to { aborted_request_ids } (those found). The
   * aborted calls fail with a PieError of codeName 'CANCELLED', reason 'REQUEST_ABORTED'. A caller
   * is its bearer token on a server with --auth-token-file; without tokens every caller is one, so
   * any PieClient (or process) may abort a request by its id.
   */
  abort(request, options) {
    return this.#unary(this.service, 'Abort', request, options);
  }

  /** Generate for a conversation rendered with the model's chat template (see chatRequest). */
  chat(messages, request = {}, options) {
    return this.generate(chatRequest(messages, request), options);
  }

  /** GenerateStream for a conversation: the async iterator of `stream`. */
  chatStream(messages, request = {}, options) {
    return this.stream(chatRequest(messages, request), options);
  }

  /** Tokenize a conversation: the ids the model sees for it, and the rendered text. */
  tokenizeChat(messages, request = {}, options) {
    const { chat } = chatRequest(messages, request);
    return this.tokenize({ chat }, options);
  }

  /** GetModelInfo: the model, and the server's load now (`load`). */
  modelInfo(options) {
    return this.#unary(this.service, 'GetModelInfo', {}, options);
  }

  /**
   * LoadAdapter: a LoRA adapter in PEFT's format, from a folder on the server's machine, under the
   * name requests give as their `adapter` ({ name, path }); resolves to { adapter } (its name, path,
   * rank, whether it holds a GPU slot). A folder that cannot be served, or a name in use, fails
   * INVALID_ARGUMENT, reason ADAPTER_INVALID, with a message naming the adapter.
   */
  loadAdapter(request, options) {
    return this.#unary(this.service, 'LoadAdapter', request, options);
  }

  /** UnloadAdapter ({ name }): requests running on it finish; new ones fail NOT_FOUND,
   * reason ADAPTER_NOT_FOUND (as a name never loaded does here). */
  unloadAdapter(request, options) {
    return this.#unary(this.service, 'UnloadAdapter', request, options);
  }

  /** ListAdapters: { adapters, max_loras, max_lora_rank }, each adapter with its requests running
   * and waiting. */
  listAdapters(options) {
    return this.#unary(this.service, 'ListAdapters', {}, options);
  }

  /** grpc.health.v1 Check: 'SERVING' or 'NOT_SERVING'. '' asks whether the process is up,
   * 'pie.v1.GenerateService' whether the model is loaded. */
  async check(service = '', options) {
    return (await this.#unary(this.health, 'Check', { service }, options)).status;
  }

  close() {
    this.service.close(); // the health client shares its channel
  }
}
