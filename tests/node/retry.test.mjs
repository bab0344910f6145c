// The client's retry policy against a server of this test's own that fails on purpose: UNAVAILABLE
// before answering is sent again (up to 4 attempts), never after the server's headers (a stream
// that began), and not at all with { retry: false }. The server is a grpc-js one serving the
// contract's GenerateService, so no pie server is involved.

import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';

import * as grpc from '@grpc/grpc-js';
import * as protoLoader from '@grpc/proto-loader';

import { DEFAULT_PROTO, PieClient, PieError, RETRY_POLICY, serviceConfig } from '../../clients/node/pie.mjs';

const flaky = { mode: 'refuse', failures: 0, calls: 0 };
let server;
let address;

function arm(mode, failures) {
  Object.assign(flaky, { mode, failures, calls: 0 });
}

const unavailable = () => ({ code: grpc.status.UNAVAILABLE, details: 'replica going away' });

before(async () => {
  const pkg = grpc.loadPackageDefinition(protoLoader.loadSync(DEFAULT_PROTO, { keepCase: true, enums: String }));
  server = new grpc.Server();
  server.addService(pkg.pie.v1.GenerateService.service, {
    Generate(call, callback) {
      flaky.calls += 1;
      if (flaky.calls <= flaky.failures) {
        if (flaky.mode === 'headers') call.sendMetadata(new grpc.Metadata());
        callback(unavailable());
        return;
      }
      callback(null, { request_id: 'r1', text: 'done', finish_reason: 'FINISH_REASON_LENGTH' });
    },
    GenerateStream(call) {
      flaky.calls += 1;
      if (flaky.calls <= flaky.failures) {
        if (flaky.mode === 'midstream') call.write({ request_id: 'r1', text: 'par' });
        call.emit('error', unavailable());
        return;
      }
      call.write({ request_id: 'r1', text: 'done', finish_reason: 'FINISH_REASON_LENGTH' });
      call.end();
    },
  });
  const port = await new Promise((resolve, reject) => server.bindAsync('127.0.0.1:0',
    grpc.ServerCredentials.createInsecure(), (error, bound) => (error ? reject(error) : resolve(bound))));
  address = `127.0.0.1:${port}`;
});

after(() => server.forceShutdown());

test('the service config holds the Python client\'s policy', () => {
  assert.deepEqual(JSON.parse(serviceConfig()), { methodConfig: [{ name: [{ service: 'pie.v1.GenerateService' }],
    retryPolicy: { maxAttempts: 4, initialBackoff: '0.1s', maxBackoff: '1s', backoffMultiplier: 2,
      retryableStatusCodes: ['UNAVAILABLE'] } }] });
  assert.equal(RETRY_POLICY.maxAttempts, 4);
});

test('UNAVAILABLE before an answer is retried, up to 4 attempts', async () => {
  const pie = new PieClient(address);
  try {
    arm('refuse', 3);
    assert.equal((await pie.generate({ prompt: 'x' })).text, 'done');
    assert.equal(flaky.calls, 4);
    arm('refuse', 3);
    const texts = [];
    for await (const message of pie.stream({ prompt: 'x' })) texts.push(message.text);
    assert.deepEqual(texts, ['done']);
    assert.equal(flaky.calls, 4);
    arm('refuse', 4); // a fifth attempt is not made
    await assert.rejects(pie.generate({ prompt: 'x' }), (e) => e instanceof PieError && e.codeName === 'UNAVAILABLE');
    assert.equal(flaky.calls, 4);
  } finally {
    pie.close();
  }
});

test('a call whose answer began is not replayed', async () => {
  const pie = new PieClient(address);
  try {
    arm('headers', 1);
    await assert.rejects(pie.generate({ prompt: 'x' }), (e) => e instanceof PieError && e.codeName === 'UNAVAILABLE');
    assert.equal(flaky.calls, 1);
    arm('midstream', 1);
    const texts = [];
    await assert.rejects((async () => {
      for await (const message of pie.stream({ prompt: 'x' })) texts.push(message.text);
    })(), (e) => e instanceof PieError && e.codeName === 'UNAVAILABLE');
    assert.deepEqual(texts, ['par']);
    assert.equal(flaky.calls, 1);
  } finally {
    pie.close();
  }
});

test('retry: false sends each call once', async () => {
  const pie = new PieClient(address, { retry: false });
  try {
    arm('refuse', 1);
    await assert.rejects(pie.generate({ prompt: 'x' }), (e) => e instanceof PieError && e.codeName === 'UNAVAILABLE');
    assert.equal(flaky.calls, 1);
  } finally {
    pie.close();
  }
});
