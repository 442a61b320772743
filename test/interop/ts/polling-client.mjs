#!/usr/bin/env node
// Interop client for stream polling (2025-11-25, SEP-1699): the official
// TypeScript SDK client, which resumes a POST stream that ends after an
// event id with a GET and Last-Event-ID, calls polling-server.mjs's
// charge_card through the idemcp sidecar (or directly, as a control):
//
//   node polling-client.mjs URL
//
// 1. charge_card {card: "4242", amount: 5}, then the same call 5 more
//    times, one after another (retries);
// 2. charge_card {card: "4242", amount: 7} 20 times at once (duplicates).
// It prints ONE JSON line:
//
//   {"protocolVersion": "...", "sequential": [CALL...], "concurrent": [CALL...]}
//   CALL = {"text", "replayed", "isError", "error"}
//
// "replayed" is result._meta["idemcp.io/replayed"] === true.

import { Client } from '@modelcontextprotocol/sdk/client/index.js';
import { StreamableHTTPClientTransport } from '@modelcontextprotocol/sdk/client/streamableHttp.js';

const url = process.argv[2];
if (!url) {
  process.stderr.write('usage: node polling-client.mjs URL\n');
  process.exit(2);
}

const transport = new StreamableHTTPClientTransport(new URL(url));
const client = new Client({ name: 'idemcp-polling-interop', version: '1.0.0' });
client.onerror = (err) => {
  if (process.env.IDEMCP_TRACE) process.stderr.write(`polling-client: transport error: ${err}\n`);
};
await client.connect(transport);

async function charge(amount) {
  try {
    const res = await client.callTool({ name: 'charge_card', arguments: { card: '4242', amount } }, undefined, { timeout: 30000 });
    return {
      text: res.content?.[0]?.text ?? '',
      replayed: res._meta?.['idemcp.io/replayed'] === true,
      isError: res.isError === true,
    };
  } catch (err) {
    return { text: '', replayed: false, isError: true, error: String(err) };
  }
}

const sequential = [];
for (let i = 0; i < 6; i++) sequential.push(await charge(5));
const concurrent = await Promise.all(Array.from({ length: 20 }, () => charge(7)));

process.stdout.write(JSON.stringify({
  protocolVersion: transport.protocolVersion,
  sequential,
  concurrent,
}) + '\n');
await client.close();
