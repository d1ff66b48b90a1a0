// A co-process hook in Node: puts the organisation's notice first in every system
// prompt, as an RFC 6902 JSON Patch against the payload. One event per line in,
// one decision per line out, carrying the event's id.
import { createInterface } from "node:readline";

const NOTICE = process.env.ORG_NOTICE || "ACME notice: customer data stays out of prompts.";

for await (const line of createInterface({ input: process.stdin })) {
  const event = JSON.parse(line);
  const answer = { id: event.id };
  const system = event.payload?.system;
  const already = Array.isArray(system) && system[0]?.text === NOTICE;
  if (event.phase === "before_provider_request" && !already) {
    const block = { type: "text", text: NOTICE };
    answer.patch =
      system === undefined
        ? [{ op: "add", path: "/system", value: [block] }]
        : typeof system === "string"
          ? [{ op: "replace", path: "/system", value: [block, { type: "text", text: system }] }]
          : [{ op: "add", path: "/system/0", value: block }];
    answer.tags = ["org-notice"];
  }
  process.stdout.write(JSON.stringify(answer) + "\n");
}
