#!/usr/bin/env node
// A Streamable HTTP MCP server built with the official TypeScript SDK that
// uses stream polling (2025-11-25, SEP-1699): its transport has an event
// store, and its tool closes the POST's SSE stream (closeSSEStream) before
// it answers, so the response reaches the client only on a GET that
// resumes the stream with Last-Event-ID.
//
//   PORT=8080 RETRY_MS=300 node polling-server.mjs
//
// Tool: charge_card {card, amount} -> "charged AMOUNT to CARD: run N".
// GET /executions answers {"charge_card": N}: how many times it ran.

import http from 'node:http';
import { randomUUID } from 'node:crypto';
import { Server } from '@modelcontextprotocol/sdk/server/index.js';
import { StreamableHTTPServerTransport } from '@modelcontextprotocol/sdk/server/streamableHttp.js';
import { InMemoryEventStore } from '@modelcontextprotocol/sdk/examples/shared/inMemoryEventStore.js';
import { CallToolRequestSchema, ListToolsRequestSchema } from '@modelcontextprotocol/sdk/types.js';

const port = Number(process.env.PORT ?? 0);
const retryMs = Number(process.env.RETRY_MS ?? 300);
const executions = {};
const transports = new Map();

function newServer() {
  const server = new Server({ name: 'idemcp-polling-server', version: '1.0.0' }, { capabilities: { tools: {} } });
  server.setRequestHandler(ListToolsRequestSchema, async () => ({
    tools: [{
      name: 'charge_card',
      description: 'Charges a card (a side effect); answers after closing its stream.',
      inputSchema: { type: 'object', properties: { card: { type: 'string' }, amount: { type: 'number' } } },
    }],
  }));
  server.setRequestHandler(CallToolRequestSchema, async (req, extra) => {
    const name = req.params.name;
    const n = (executions[name] = (executions[name] ?? 0) + 1);
    if (!extra.closeSSEStream) throw new Error('closeSSEStream is unavailable: no event store, or a client older than 2025-11-25');
    extra.closeSSEStream();
    await new Promise((r) => setTimeout(r, 200));
    const args = req.params.arguments ?? {};
    return { content: [{ type: 'text', text: `charged ${args.amount} to ${args.card}: run ${n}` }] };
  });
  return server;
}

const httpServer = http.createServer(async (req, res) => {
  try {
    if (req.url === '/executions') {
      res.setHeader('Content-Type', 'application/json');
      res.end(JSON.stringify(executions));
      return;
    }
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
        eventStore: new InMemoryEventStore(),
        retryInterval: retryMs,
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
    process.stderr.write(`polling-server: ${err && err.stack ? err.stack : err}\n`);
    if (!res.headersSent) res.writeHead(500).end();
  }
});

httpServer.listen(port, '127.0.0.1', () => {
  process.stdout.write(`listening ${httpServer.address().port}\n`);
});
