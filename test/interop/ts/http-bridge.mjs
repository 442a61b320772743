#!/usr/bin/env node
// Serves a stdio MCP server over Streamable HTTP, so that the sidecar can
// be tested in front of the reference servers that speak only stdio. The
// bridge is a thin relay built with the official TypeScript SDK: one stdio
// client to the server, and per HTTP session a server that answers
// tools/list and tools/call with exactly what the stdio server answered
// (annotations, results and errors untouched).
//
//   PORT=0 node http-bridge.mjs node node_modules/.../dist/index.js DIR
//
// It prints "listening PORT" once it serves.

import http from 'node:http';
import { randomUUID } from 'node:crypto';
import { Client } from '@modelcontextprotocol/sdk/client/index.js';
import { StdioClientTransport } from '@modelcontextprotocol/sdk/client/stdio.js';
import { Server } from '@modelcontextprotocol/sdk/server/index.js';
import { StreamableHTTPServerTransport } from '@modelcontextprotocol/sdk/server/streamableHttp.js';
import { CallToolRequestSchema, CallToolResultSchema, ListToolsRequestSchema } from '@modelcontextprotocol/sdk/types.js';

const [command, ...args] = process.argv.slice(2);
if (!command) {
  process.stderr.write('usage: http-bridge.mjs COMMAND [ARGS...]\n');
  process.exit(2);
}
const upstream = new Client({ name: 'idemcp-http-bridge', version: '1.0.0' });
await upstream.connect(new StdioClientTransport({ command, args, env: process.env, stderr: 'inherit' }));

function newServer() {
  const server = new Server({ name: 'idemcp-http-bridge', version: '1.0.0' }, { capabilities: { tools: {} } });
  server.setRequestHandler(ListToolsRequestSchema, async (req) => upstream.listTools(req.params));
  server.setRequestHandler(CallToolRequestSchema, async (req) => upstream.callTool(req.params, CallToolResultSchema));
  return server;
}

const transports = new Map();
const httpServer = http.createServer(async (req, res) => {
  try {
    const sid = req.headers['mcp-session-id'];
    let transport = sid ? transports.get(sid) : undefined;
    if (!transport) {
      if (sid || req.method !== 'POST') {
        res.writeHead(404, { 'Content-Type': 'application/json' });
        res.end(JSON.stringify({ jsonrpc: '2.0', id: null, error: { code: -32001, message: 'Session not found' } }));
        return;
      }
      const t = new StreamableHTTPServerTransport({
        sessionIdGenerator: () => randomUUID(),
        onsessioninitialized: (id) => transports.set(id, t),
      });
      t.onclose = () => {
        if (t.sessionId) transports.delete(t.sessionId);
      };
      await newServer().connect(t);
      transport = t;
    }
    await transport.handleRequest(req, res);
  } catch (err) {
    process.stderr.write(`http-bridge: ${err && err.stack ? err.stack : err}\n`);
    if (!res.headersSent) res.writeHead(500).end();
  }
});

httpServer.listen(Number(process.env.PORT ?? 0), '127.0.0.1', () => {
  process.stdout.write(`listening ${httpServer.address().port}\n`);
});
