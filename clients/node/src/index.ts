// sandq: run code in sandq's sandboxes from Node.js (docs/protocol.md).
//
//   import { Client } from "sandq";
//   const client = await Client.connect();          // $SANDQ_CONFIG, else /etc/sandq/sandq.toml
//   const data = await client.upload("data.csv");
//   const result = await client.run({ code: "import pandas as pd\npd.read_csv('data.csv').describe()", inputs: [data] });
//   // Output as it happens (docs/protocol.md "Live events"), then the stored result:
//   await client.run({ code: "for i in range(3): print(i)" }, { onStdout: (text) => process.stdout.write(text) });
//   for await (const event of client.events(result.job_id)) console.log(event.type, event.data);
//   await client.close();
//
// Over HTTP, through sandq-gateway (docs/gateway.md), the same calls with an API key:
//
//   const client = new Client({ url: "https://sandq.example.com", apiKey: process.env.KEY });
//   // or new Client() / await Client.connect() with $SANDQ_URL and $SANDQ_API_KEY set
export {
  Client, Session, clientMode, redisClient, connectAny, type ClientOptions, type WaitOptions, type RunOptions, type EventsOptions, type SessionSummary,
} from "./client.js";
export { SseParser, parseGatewayEvent, type SseMessage } from "./sse.js";
export { gatewayJob } from "./gateway.js";
export { Transcript, parseEvent, parseXRead, callbacksFor, type EventCallbacks } from "./events.js";
export * from "./errors.js";
export {
  loadConfig, configPath, urlList, amqpAddresses, parseUrls, type Config, Names, CAS_SCRIPT, SCHEMA_VERSION, buildJob, humantimeSeconds,
  EVENTS_START, EVENTS_COUNT,
} from "./protocol.js";
export * from "./types.js";
