#!/usr/bin/env node
// Interop client for `idemcp wrap`: the official TypeScript MCP SDK drives
// a stdio MCP server through StdioClientTransport.
//
//   node wrap-client.mjs CMD [ARGS...]
//
// CMD is the server's command: `idemcp wrap -- node .../server-everything
// stdio`, or the server itself as a control. The script connects, lists
// tools, then makes the calls named in the CALLS environment variable, a
// JSON array of {"name": ..., "arguments": {...}}, in order, and prints ONE
// JSON line to stdout:
//
//   {"server": {...}, "tools": [{"name": "...", "readOnlyHint": bool}],
//    "calls": [{"name": "...", "text": "...", "replayed": bool, "isError": bool}]}
//
// "replayed" is result._meta["idemcp.io/replayed"] === true. The server's
// stderr is passed through. Any error: a message on stderr and exit 1.

import { Client } from '@modelcontextprotocol/sdk/client/index.js';
import { StdioClientTransport } from '@modelcontextprotocol/sdk/client/stdio.js';

const [command, ...args] = process.argv.slice(2);
if (!command) {
  process.stderr.write('usage: CALLS=[...] node wrap-client.mjs CMD [ARGS...]\n');
  process.exit(2);
}

function fail(msg, err) {
  const detail = err ? `: ${err && err.stack ? err.stack : err}` : '';
  process.stderr.write(`wrap-client: ${msg}${detail}\n`);
  process.exit(1);
}

process.on('unhandledRejection', (err) => fail('unhandled rejection', err));

let plan;
try {
  plan = JSON.parse(process.env.CALLS ?? '[]');
} catch (err) {
  fail('CALLS is not JSON', err);
}

const client = new Client({ name: 'idemcp-wrap-interop', version: '1.0.0' });
client.onerror = (err) => process.stderr.write(`wrap-client: client.onerror: ${err}\n`);
const transport = new StdioClientTransport({ command, args, stderr: 'inherit' });

try {
  await client.connect(transport);
} catch (err) {
  fail(`connecting (initialize) to ${command} ${args.join(' ')}`, err);
}

let tools;
try {
  const listed = await client.listTools();
  tools = listed.tools.map((t) => ({ name: t.name, readOnlyHint: t.annotations?.readOnlyHint === true }));
} catch (err) {
  fail('tools/list', err);
}

const calls = [];
for (const { name, arguments: callArgs } of plan) {
  let res;
  try {
    res = await client.callTool({ name, arguments: callArgs ?? {} });
  } catch (err) {
    fail(`tools/call ${name}`, err);
  }
  calls.push({
    name,
    text: (res.content || [])
      .filter((c) => c.type === 'text')
      .map((c) => c.text)
      .join('\n'),
    replayed: res._meta?.['idemcp.io/replayed'] === true,
    isError: res.isError === true,
  });
}

const out = { server: client.getServerVersion() ?? null, tools, calls };
try {
  await client.close();
} catch (err) {
  fail('closing the client', err);
}
process.stdout.write(JSON.stringify(out) + '\n');
process.exit(0);
