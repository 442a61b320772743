#!/usr/bin/env node
// Interop client: the official TypeScript MCP SDK drives an MCP endpoint
// (the idemcp sidecar, or the server directly as a control).
//
//   node client.mjs URL
//
// It connects (initialize), lists tools, calls charge_card twice with the
// same arguments, then twice more with the explicit key
// _meta["idempotency-key"] = "ts-key-1", and prints ONE JSON line to stdout:
//
//   {"protocolVersion": "...", "server": {...}, "tools": ["..."],
//    "calls": [{"text": "...", "replayed": bool, "replayedHeader": "...",
//               "structured": {...}, "isError": bool, "key": "..."}, ...],
//    "http": [{"method": "POST", "rpc": "tools/call", "status": 200, ...}]}
//
// "replayed" is result._meta["idemcp.io/replayed"] === true; "replayedHeader"
// is the HTTP response header Idempotent-Replayed of the POST that carried
// the call. "http" lists every HTTP exchange the SDK made, with the request
// headers it sent, for whoever wants to see how the SDK talks. Set
// IDEMCP_TRACE=1 to also log them to stderr as they happen.
//
// Any error: a message on stderr and exit status 1.

import { Client } from '@modelcontextprotocol/sdk/client/index.js';
import { StreamableHTTPClientTransport } from '@modelcontextprotocol/sdk/client/streamableHttp.js';

const url = process.argv[2];
if (!url) {
  process.stderr.write('usage: node client.mjs URL\n');
  process.exit(2);
}

const trace = !!process.env.IDEMCP_TRACE;
const http = [];

function headersObject(h) {
  const out = {};
  if (!h) return out;
  new Headers(h).forEach((v, k) => {
    out[k] = v;
  });
  return out;
}

// recordingFetch wraps fetch to record each exchange's headers; bodies are
// passed through untouched (a response may be an SSE stream).
async function recordingFetch(input, init = {}) {
  const method = (init.method || 'GET').toUpperCase();
  let rpc;
  if (typeof init.body === 'string') {
    try {
      const msg = JSON.parse(init.body);
      const msgs = Array.isArray(msg) ? msg : [msg];
      rpc = msgs.map((m) => m.method ?? (m.result !== undefined ? 'response' : 'error')).join(',');
    } catch {
      rpc = 'unparsable body';
    }
  }
  const entry = { method, rpc, requestHeaders: headersObject(init.headers) };
  http.push(entry);
  let res;
  try {
    res = await fetch(input, init);
  } catch (err) {
    entry.error = String(err);
    if (trace) process.stderr.write(`ts-client: ${method} ${rpc ?? ''} failed: ${err}\n`);
    throw err;
  }
  entry.status = res.status;
  entry.responseHeaders = headersObject(res.headers);
  if (trace) process.stderr.write(`ts-client: ${JSON.stringify(entry)}\n`);
  return res;
}

function fail(msg, err) {
  const detail = err ? `: ${err && err.stack ? err.stack : err}` : '';
  process.stderr.write(`ts-client: ${msg}${detail}\n`);
  if (http.length) process.stderr.write(`ts-client: HTTP exchanges so far: ${JSON.stringify(http)}\n`);
  process.exit(1);
}

process.on('unhandledRejection', (err) => fail('unhandled rejection', err));

const client = new Client({ name: 'idemcp-ts-interop', version: '1.0.0' });
client.onerror = (err) => {
  // Transport-level errors (e.g. the optional GET SSE stream) land here;
  // record them, the calls themselves fail loudly if they matter.
  if (trace) process.stderr.write(`ts-client: client.onerror: ${err}\n`);
  http.push({ clientError: String(err) });
};
const transport = new StreamableHTTPClientTransport(new URL(url), { fetch: recordingFetch });

try {
  await client.connect(transport);
} catch (err) {
  fail(`connecting (initialize) to ${url}`, err);
}

let tools;
try {
  const listed = await client.listTools();
  tools = listed.tools.map((t) => t.name);
} catch (err) {
  fail('tools/list', err);
}
if (!tools.includes('charge_card')) fail(`tools/list has no charge_card: ${JSON.stringify(tools)}`);

// Calls are sequential, so the last POST that carried a tools/call is the
// one whose response headers belong to the result just returned.
function lastCallExchange() {
  for (let i = http.length - 1; i >= 0; i--) {
    const e = http[i];
    if (e.method === 'POST' && e.rpc === 'tools/call') return e;
  }
  return undefined;
}

const args = { card: '4242', amount: 12.5 };
const calls = [];
async function charge(key) {
  const params = { name: 'charge_card', arguments: args };
  if (key !== undefined) params._meta = { 'idempotency-key': key };
  let res;
  try {
    res = await client.callTool(params);
  } catch (err) {
    fail(`tools/call charge_card (key ${key ?? 'none'})`, err);
  }
  const text = (res.content || [])
    .filter((c) => c.type === 'text')
    .map((c) => c.text)
    .join('\n');
  const exchange = lastCallExchange();
  calls.push({
    key: key ?? null,
    text,
    replayed: res._meta?.['idemcp.io/replayed'] === true,
    replayedHeader: exchange?.responseHeaders?.['idempotent-replayed'] ?? null,
    structured: res.structuredContent ?? null,
    isError: res.isError === true,
    meta: res._meta ?? null,
  });
}

await charge();
await charge();
await charge('ts-key-1');
await charge('ts-key-1');

const out = {
  protocolVersion: transport.protocolVersion ?? null,
  sessionId: transport.sessionId ?? null,
  server: client.getServerVersion() ?? null,
  tools,
  calls,
};

// End the session the way a well-behaved client does: DELETE, then close.
try {
  await transport.terminateSession();
} catch (err) {
  fail('terminating the session (HTTP DELETE)', err);
}
try {
  await client.close();
} catch (err) {
  fail('closing the client', err);
}
out.http = http;

process.stdout.write(JSON.stringify(out) + '\n');
process.exit(0);
