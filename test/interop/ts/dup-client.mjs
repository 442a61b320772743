#!/usr/bin/env node
// Duplicate client: the official TypeScript MCP SDK sends concurrent
// duplicates and a conflicting explicit key to an MCP endpoint.
//
//   node dup-client.mjs URL
//
// It sends 20 identical charge_card calls at once, then charge_card with
// _meta["idempotency-key"] = "ts-dup-1", then the same key with another
// amount, and prints ONE JSON line:
//
//   {"protocolVersion": "...",
//    "concurrent": [{"text": "...", "replayed": bool}, ...],
//    "keyed": {"text": "...", "replayed": bool},
//    "conflict": {"code": -32001, "message": "..."} or null}
//
// Any other error: a message on stderr and exit status 1.

import { Client } from '@modelcontextprotocol/sdk/client/index.js';
import { StreamableHTTPClientTransport } from '@modelcontextprotocol/sdk/client/streamableHttp.js';

const url = process.argv[2];
if (!url) {
  process.stderr.write('usage: node dup-client.mjs URL\n');
  process.exit(2);
}

function fail(msg, err) {
  process.stderr.write(`dup-client: ${msg}${err ? `: ${err.stack ?? err}` : ''}\n`);
  process.exit(1);
}

const client = new Client({ name: 'idemcp-ts-dup', version: '1.0.0' });
const transport = new StreamableHTTPClientTransport(new URL(url));
try {
  await client.connect(transport);
} catch (err) {
  fail(`connecting to ${url}`, err);
}

function summary(res) {
  return {
    text: (res.content || []).filter((c) => c.type === 'text').map((c) => c.text).join('\n'),
    replayed: res._meta?.['idemcp.io/replayed'] === true,
    isError: res.isError === true,
  };
}

const dup = { name: 'charge_card', arguments: { card: '4242', amount: 20, delayMs: 300 } };
let concurrent;
try {
  concurrent = (await Promise.all(Array.from({ length: 20 }, () => client.callTool(dup)))).map(summary);
} catch (err) {
  fail('concurrent tools/call', err);
}

const key = { 'idempotency-key': 'ts-dup-1' };
let keyed;
try {
  keyed = summary(await client.callTool({ name: 'charge_card', arguments: { card: '1', amount: 1 }, _meta: key }));
} catch (err) {
  fail('keyed tools/call', err);
}
let conflict = null;
try {
  await client.callTool({ name: 'charge_card', arguments: { card: '1', amount: 2 }, _meta: key });
} catch (err) {
  conflict = { code: err.code ?? null, message: String(err.message ?? err) };
}

const out = { protocolVersion: transport.protocolVersion ?? null, concurrent, keyed, conflict };
try {
  await transport.terminateSession();
  await client.close();
} catch (err) {
  fail('closing', err);
}
process.stdout.write(JSON.stringify(out) + '\n');
process.exit(0);
