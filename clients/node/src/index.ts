// sandq: run code in sandq's sandboxes from Node.js (docs/protocol.md).
//
//   import { Client } from "sandq";
//   const client = await Client.connect();          // $SANDQ_CONFIG, else /etc/sandq/sandq.toml
//   const data = await client.upload("data.csv");
//   const result = await client.run({ code: "import pandas as pd\npd.read_csv('data.csv').describe()", inputs: [data] });
//   await client.close();
export { Client, Session, redisClient, connectAny, type ClientOptions, type WaitOptions } from "./client.js";
export * from "./errors.js";
export { loadConfig, configPath, urlList, amqpAddresses, parseUrls, type Config, Names, CAS_SCRIPT, SCHEMA_VERSION, buildJob, humantimeSeconds } from "./protocol.js";
export * from "./types.js";
