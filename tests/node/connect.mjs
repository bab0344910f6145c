// What every Node test shares: the address of the pie server under test (PIE_ADDRESS, set by
// tests/clients/test_node_client.py, which starts one), and waiting on a condition.

import { PieClient } from '../../clients/node/pie.mjs';

export const ADDRESS = process.env.PIE_ADDRESS;
if (!ADDRESS) {
  throw new Error('PIE_ADDRESS is not set: these tests call a running `pie serve` '
    + '(python -m pytest tests/clients/test_node_client.py starts one and sets it)');
}

export function connect(options) {
  return new PieClient(ADDRESS, options);
}

/** The server's load now (GetModelInfo's `load`). */
export async function loadOf(pie) {
  return (await pie.modelInfo()).load;
}

/** Nothing running or waiting, and every KV block free. */
export const idle = (load) => load.requests_running === 0 && load.requests_waiting === 0
  && load.kv_blocks_free === load.kv_blocks_total;

/** Calls `probe` until `done(value)` holds, and returns that value; fails after `timeoutMs`
 * with the last value seen. */
export async function waitFor(probe, done, { timeoutMs = 10_000, intervalMs = 20, what = 'the condition' } = {}) {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const value = await probe();
    if (done(value)) return value;
    if (Date.now() > deadline) {
      throw new Error(`${what} did not hold within ${timeoutMs} ms; last seen: ${JSON.stringify(value)}`);
    }
    await new Promise((resolve) => setTimeout(resolve, intervalMs));
  }
}
