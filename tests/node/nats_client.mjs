// A NATS client not written in Python: nats.js asks a query worker as README's "Your own NATS client" says.
// Usage: node nats_client.mjs SERVER USER PASSWORD SUBJECT BODY_JSON
// Prints one JSON object: the replies to BODY with and without the timeout header, to a malformed body, and what
// a connection without the user's inbox prefix gets.
import { connect, headers, StringCodec } from "nats";

const [server, user, pass, subject, body] = process.argv.slice(2);
const codec = StringCodec();

async function ask(nc, data, timeoutMs) {
  const options = { timeout: 2000 };
  if (timeoutMs !== undefined) {
    options.headers = headers();
    options.headers.set("Ontofabric-Timeout-Ms", String(timeoutMs));
  }
  try {
    return JSON.parse(codec.decode((await nc.request(subject, codec.encode(data), options)).data));
  } catch (error) {
    return { clientError: String(error.code ?? error.message) };
  }
}

const nc = await connect({ servers: server, user, pass, inboxPrefix: `_INBOX.${user}` });
const seen = {
  stated: await ask(nc, body, 2000),
  unstated: await ask(nc, body),
  malformed: await ask(nc, '{"semanticQuery": 5, "topK": "ten"}', 2000),
};
await nc.close();
const plain = await connect({ servers: server, user, pass });
seen.withoutInboxPrefix = await ask(plain, body, 2000);
await plain.close();
console.log(JSON.stringify(seen));
