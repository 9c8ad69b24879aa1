// A client not written in Python: the TypeScript MCP SDK drives `ontofabric mcp` over stdio.
// Usage: node client.mjs ARGUMENTS_JSON -- COMMAND [ARGS...]
// Prints one JSON object: the tools listed, and the results of a valid and an invalid ontology_query call.
// The SDK's Client validates structuredContent against each tool's outputSchema itself (it throws otherwise).
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StdioClientTransport } from "@modelcontextprotocol/sdk/client/stdio.js";

const separator = process.argv.indexOf("--");
const queryArguments = JSON.parse(process.argv[2]);
const [command, ...args] = process.argv.slice(separator + 1);
const transport = new StdioClientTransport({ command, args, env: process.env, stderr: "inherit" });
const client = new Client({ name: "ontofabric-node-test", version: "1.0.0" });
await client.connect(transport);
const listed = await client.listTools();
const answer = await client.callTool({ name: "ontology_query", arguments: queryArguments });
const refused = await client.callTool({ name: "ontology_query", arguments: { semanticQuery: "x", topK: 0 } });
console.log(JSON.stringify({
  tools: listed.tools.map((tool) => ({ name: tool.name, annotations: tool.annotations, outputSchema: !!tool.outputSchema })),
  answer,
  refused,
}));
await client.close();
