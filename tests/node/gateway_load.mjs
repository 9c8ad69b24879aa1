// Sustained load on an HTTP MCP gateway through the TypeScript MCP SDK, as many agents' clients meet it
// (tests/benchmarks/bench_gateway_overload.py runs it). A process of its own, so that the load's own work does not
// share the gateway's event loop.
// Usage: node gateway_load.mjs URL WORKSPACE RATE SECONDS SESSIONS TIMEOUT_MS OUT_FILE
// RATE ontology_query calls a second, evenly spaced, spread over SESSIONS sessions, each call given TIMEOUT_MS;
// beside them an MCP ping every 100 ms on a session of its own (its round trip: how far behind the gateway is).
// Writes one JSON line per call ({"kind": "call", "start", "seconds", "outcome", "text"}) and per ping
// ({"kind": "ping", "start", "seconds", "ok"}) to OUT_FILE, start in seconds from the first call.
import { setMaxListeners } from "node:events";
import fs from "node:fs";
import { performance } from "node:perf_hooks";
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";

const [url, workspace, rate, seconds, sessionCount, timeoutMs, outFile] = process.argv.slice(2);
setMaxListeners(0); // a session's transport listens on one abort signal for each of its calls in flight
const out = fs.createWriteStream(outFile);
const words = ["delta", "projector", "dead letter", "embedding", "fusion", "gateway token", "rebuild", "receipt",
  "retry budget", "freshness", "late interaction", "keyword", "workspace branch", "calibration", "chunk"];

async function open(name) {
  const client = new Client({ name, version: "1.0.0" });
  await client.connect(new StreamableHTTPClientTransport(new URL(url)));
  return client;
}

const sessions = [];
for (let i = 0; i < Number(sessionCount); i++) sessions.push(await open(`load-${i}`));
const pinger = await open("ping");
const began = performance.now();
const clock = () => (performance.now() - began) / 1000;

function outcomeOf(result) {
  const text = (result.content ?? []).map((block) => block.text ?? "").join("\n");
  if (!result.isError) return ["answered", ""];
  return [text.split(/[ :(]/, 2)[1] ?? "error", text.slice(0, 120)];
}

async function call(index) {
  const start = clock();
  const line = { kind: "call", start };
  try {
    const words2 = `${words[index % words.length]} ${words[(index * 7 + 3) % words.length]} ${index}`;
    const result = await sessions[index % sessions.length].callTool(
      { name: "ontology_query", arguments: { semanticQuery: `how does ${words2} work`, workspace } },
      undefined,
      { timeout: Number(timeoutMs) },
    );
    [line.outcome, line.text] = outcomeOf(result);
  } catch (error) {
    const message = String(error?.message ?? error);
    line.outcome = /timed out|timeout/i.test(message) ? "client_timeout" : "transport_error";
    line.text = message.slice(0, 120);
  }
  line.seconds = clock() - start;
  out.write(JSON.stringify(line) + "\n");
}

let pinging = true;
const pings = (async () => {
  while (pinging) {
    const start = clock();
    let ok = true;
    try {
      await pinger.ping({ timeout: 30000 });
    } catch {
      ok = false;
    }
    out.write(JSON.stringify({ kind: "ping", start, seconds: clock() - start, ok }) + "\n");
    await new Promise((resolve) => setTimeout(resolve, Math.max(0, 100 - (clock() - start) * 1000)));
  }
})();

const calls = [];
const total = Math.round(Number(rate) * Number(seconds));
for (let i = 0; i < total; i++) {
  const due = i / Number(rate);
  const wait = (due - clock()) * 1000;
  if (wait > 0) await new Promise((resolve) => setTimeout(resolve, wait));
  calls.push(call(i));
}
await Promise.allSettled(calls);
pinging = false;
await pings;
for (const client of [...sessions, pinger]) await client.close().catch(() => {});
await new Promise((resolve) => out.end(resolve));
