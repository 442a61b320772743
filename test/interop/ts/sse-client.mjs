#!/usr/bin/env node
// Interop client for the legacy HTTP+SSE transport (2024-11-05): the
// official TypeScript MCP SDK's SSEClientTransport drives the reference
// server @modelcontextprotocol/server-everything in `sse` mode, through the
// idemcp sidecar (or directly, as a control).
//
//   node sse-client.mjs URL        (URL is the SSE endpoint, such as http://127.0.0.1:8081/sse)
//
// It connects, lists tools, then calls:
//   1-2. toggle-simulated-logging {} twice (not read-only; each run flips
//        the session's simulated logging on or off, so its text tells runs
//        apart: "Started ..." then "Stopped ...");
//   3.   toggle-simulated-logging {} with the explicit key
//        _meta["idempotency-key"] = "sse-toggle-2" (a distinct operation);
//   4-5. gzip-file-as-resource with the same arguments twice (annotated
//        idempotentHint: true, so Auto passes both through);
//   6.   gzip-file-as-resource with another file name;
//   7-8. echo twice (readOnlyHint: true).
// and prints ONE JSON line to stdout:
//
//   {"protocolVersion": "...", "server": {...}, "tools": [{"name", "readOnly"}],
//    "calls": [{"label", "tool", "text", "replayed", "isError"}],
//    "wire": [{"dir": "out"|"in", "id", "method", "replayed", "error"}]}
//
// "replayed" is result._meta["idemcp.io/replayed"] === true. "wire" lists
// the JSON-RPC messages sent and received after initialization, so the
// caller can check that every request got exactly one response with its id.
// Set IDEMCP_TRACE=1 to log them to stderr as they happen.
//
// Any error: a message on stderr and exit status 1.

import { Client } from '@modelcontextprotocol/sdk/client/index.js';
import { SSEClientTransport } from '@modelcontextprotocol/sdk/client/sse.js';

const url = process.argv[2];
if (!url) {
  process.stderr.write('usage: node sse-client.mjs SSE_URL\n');
  process.exit(2);
}
const trace = !!process.env.IDEMCP_TRACE;
const wire = [];

function record(dir, msg) {
  const entry = { dir, id: msg.id ?? null, method: msg.method ?? null };
  if (msg.result !== undefined) entry.replayed = msg.result?._meta?.['idemcp.io/replayed'] === true;
  if (msg.error !== undefined) entry.error = msg.error.code;
  wire.push(entry);
  if (trace) process.stderr.write(`sse-client: ${dir} ${JSON.stringify(msg).slice(0, 300)}\n`);
}

function fail(msg, err) {
  const detail = err ? `: ${err && err.stack ? err.stack : err}` : '';
  process.stderr.write(`sse-client: ${msg}${detail}\n`);
  if (wire.length) process.stderr.write(`sse-client: messages so far: ${JSON.stringify(wire)}\n`);
  process.exit(1);
}

const transport = new SSEClientTransport(new URL(url));
const client = new Client({ name: 'idemcp-sse-interop', version: '1.0.0' });
client.onerror = (err) => {
  if (trace) process.stderr.write(`sse-client: transport error: ${err}\n`);
};

try {
  await client.connect(transport);
} catch (err) {
  fail(`connecting to ${url}`, err);
}
// Record what goes over the wire from here on. The SDK's Protocol looks
// both up on the transport at each use.
const send = transport.send.bind(transport);
transport.send = (msg, opts) => {
  record('out', msg);
  return send(msg, opts);
};
const onmessage = transport.onmessage;
transport.onmessage = (msg, extra) => {
  record('in', msg);
  onmessage?.(msg, extra);
};

const out = {
  protocolVersion: transport._protocolVersion ?? null,
  server: client.getServerVersion() ?? null,
  tools: [],
  calls: [],
  wire,
};

try {
  const listed = await client.listTools();
  out.tools = listed.tools.map((t) => ({ name: t.name, readOnly: t.annotations?.readOnlyHint === true }));
} catch (err) {
  fail('tools/list', err);
}

async function callTool(label, name, args, meta) {
  const params = { name, arguments: args };
  if (meta) params._meta = meta;
  let res;
  try {
    res = await client.callTool(params, undefined, { timeout: 20000 });
  } catch (err) {
    fail(`calling ${name} (${label})`, err);
  }
  const first = (res.content ?? [])[0] ?? {};
  out.calls.push({
    label,
    tool: name,
    text: first.text ?? (first.resource ? JSON.stringify(first.resource) : JSON.stringify(first)),
    replayed: res._meta?.['idemcp.io/replayed'] === true,
    isError: res.isError === true,
  });
}

const gz = (file) => ({ name: file, data: 'data:text/plain;base64,aGVsbG8gaWRlbWNw', outputType: 'resource' });
await callTool('toggle', 'toggle-simulated-logging', {});
await callTool('toggle retry', 'toggle-simulated-logging', {});
await callTool('toggle, new key', 'toggle-simulated-logging', {}, { 'idempotency-key': 'sse-toggle-2' });
await callTool('gzip a', 'gzip-file-as-resource', gz('idemcp-a.txt.gz'));
await callTool('gzip a retry', 'gzip-file-as-resource', gz('idemcp-a.txt.gz'));
await callTool('gzip b', 'gzip-file-as-resource', gz('idemcp-b.txt.gz'));
await callTool('echo', 'echo', { message: 'hello' });
await callTool('echo again', 'echo', { message: 'hello' });

process.stdout.write(JSON.stringify(out) + '\n');
await client.close();
process.exit(0);
