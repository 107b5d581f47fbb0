// Calls made with the official OpenAI and Anthropic Node SDKs at their defaults (maxRetries 2,
// their own retry of a 429), for the SDK tests of e2e/sdk_test.go. argv[2] is a JSON list of
// calls, each {sdk: "openai"|"anthropic", base, key, stream, identity, after, headers}, started
// `after` ms after the previous one was started (in parallel with it), or, without `after`,
// once it ended. Prints one JSON line per call, in the order given: {ok, status, ms, usage,
// text, error}.
import OpenAI from "openai";
import Anthropic from "@anthropic-ai/sdk";

async function call(c) {
  const headers = { ...(c.headers ?? {}) };
  if (c.identity) headers["accept-encoding"] = "identity";
  const t0 = Date.now();
  try {
    let usage, text = "";
    if (c.sdk === "openai") {
      const client = new OpenAI({ baseURL: c.base, apiKey: c.key, defaultHeaders: headers });
      const req = { model: "gpt-4o", messages: [{ role: "user", content: "hi" }] };
      if (c.stream) {
        for await (const chunk of await client.chat.completions.create({ ...req, stream: true })) {
          text += chunk.choices?.[0]?.delta?.content ?? "";
          usage = chunk.usage ?? usage;
        }
      } else {
        const r = await client.chat.completions.create(req);
        usage = r.usage;
        text = r.choices[0].message.content;
      }
    } else {
      const client = new Anthropic({ baseURL: c.base, apiKey: c.key, defaultHeaders: headers });
      const req = { model: "claude-sonnet-4-5", max_tokens: 1024, messages: [{ role: "user", content: "Hello" }] };
      const m = c.stream ? await client.messages.stream(req).finalMessage() : await client.messages.create(req);
      usage = m.usage;
      text = m.content.map((b) => b.text).join("");
    }
    return { ok: true, status: 200, ms: Date.now() - t0, usage, text };
  } catch (e) {
    return { ok: false, status: e.status ?? 0, ms: Date.now() - t0, error: `${e.name}: ${e.message}` };
  }
}

const calls = JSON.parse(process.argv[2]);
const results = [];
let previous = Promise.resolve();
for (const c of calls) {
  if (c.after !== undefined) {
    await new Promise((r) => setTimeout(r, c.after));
  } else {
    await previous;
  }
  previous = call(c);
  results.push(previous);
}
for (const r of await Promise.all(results)) console.log(JSON.stringify(r));
