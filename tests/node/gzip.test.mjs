// A gzip-compressed call: the client compresses its requests (grpc-js channel option
// grpc.default_compression_algorithm), the server reads them. A relay between the two counts the
// bytes the client sends, so the test sees the compression on the wire, not only the answer.

import assert from 'node:assert/strict';
import net from 'node:net';
import { test } from 'node:test';

import { PieClient } from '../../clients/node/pie.mjs';
import { ADDRESS } from './connect.mjs';

/** A TCP relay to the server on a free loopback port; `sent()` is the bytes clients wrote to it. */
async function relay() {
  const split = ADDRESS.lastIndexOf(':');
  const [host, port] = [ADDRESS.slice(0, split), Number(ADDRESS.slice(split + 1))];
  let sent = 0;
  const sockets = new Set();
  const server = net.createServer((client) => {
    const upstream = net.connect(port, host);
    for (const socket of [client, upstream]) {
      sockets.add(socket);
      socket.on('error', () => { client.destroy(); upstream.destroy(); });
    }
    client.on('data', (chunk) => { sent += chunk.length; });
    client.pipe(upstream);
    upstream.pipe(client);
  });
  await new Promise((resolve) => server.listen(0, '127.0.0.1', resolve));
  return {
    address: `127.0.0.1:${server.address().port}`,
    sent: () => sent,
    close: () => {
      for (const socket of sockets) socket.destroy();
      server.close();
    },
  };
}

async function tokenizeThrough(compression, text) {
  const wire = await relay();
  const pie = new PieClient(wire.address, { compression });
  try {
    const tokens = await pie.tokenize({ text });
    const done = await pie.generate({ prompt: text.slice(0, 200), sampling: { max_tokens: 4, ignore_eos: true } });
    return { count: tokens.count, completion: done.usage.completion_tokens, sent: wire.sent() };
  } finally {
    pie.close();
    wire.close();
  }
}

test('gzip: requests go compressed and the server answers them as it answers plain ones', async () => {
  const text = 'the cat sat on the mat. '.repeat(2000); // 48,000 characters, compressible
  const plain = await tokenizeThrough('none', text);
  const gzip = await tokenizeThrough('gzip', text);
  assert.equal(gzip.count, plain.count);
  assert.equal(gzip.completion, 4);
  assert.ok(plain.sent > text.length, `plain: ${plain.sent} bytes sent`);
  assert.ok(gzip.sent < text.length / 10, `gzip: ${gzip.sent} bytes sent for ${text.length} characters`);
});
