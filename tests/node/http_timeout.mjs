// The TypeScript MCP SDK over streamable HTTP, without a token: one tool call whose client gives up after
// TIMEOUT_MS (the SDK then sends notifications/cancelled in a POST of its own), then the process stays for
// STAY_MS with the call's POST still open, as a long-lived agent would.
// Usage: node http_timeout.mjs URL TIMEOUT_MS STAY_MS
// Prints one JSON object: the error the call ended with, and the session id the gateway gave at initialize.
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";

const [url, timeoutMs, stayMs] = process.argv.slice(2);
const transport = new StreamableHTTPClientTransport(new URL(url));
const client = new Client({ name: "ontofabric-node-timeout", version: "1.0.0" });
await client.connect(transport);
let error = null;
try {
  await client.callTool({ name: "ontology_query", arguments: { semanticQuery: "csv" } }, undefined, {
    timeout: Number(timeoutMs),
  });
} catch (caught) {
  error = String(caught);
}
await new Promise((resolve) => setTimeout(resolve, Number(stayMs)));
console.log(JSON.stringify({ error, sessionId: transport.sessionId ?? null }));
process.exit(0);
