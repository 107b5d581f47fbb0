// Concurrent LLM calls made with the official OpenAI, Anthropic and Google Gen AI Node SDKs at
// their defaults, for the budget test of e2e/budget_test.go. argv[2] is a JSON list of calls,
// each {sdk: "openai"|"anthropic"|"gemini", base, key, stream, identity, maxTokens}, all started
// at once. Prints one JSON line per call, in the order given: {ok, status, ms, finish, error}:
// finish is the reason the response says it stopped ("length", "max_tokens", "MAX_TOKENS"), read
// from a complete response only.
import OpenAI from "openai";
import Anthropic from "@anthropic-ai/sdk";
import { GoogleGenAI } from "@google/genai";

async function call(c) {
  const headers = {};
  if (c.identity) headers["accept-encoding"] = "identity";
  const t0 = Date.now();
  try {
    let finish;
    if (c.sdk === "openai") {
      const client = new OpenAI({ baseURL: c.base + "/v1", apiKey: c.key, defaultHeaders: headers });
      const req = { model: "gpt-4o", messages: [{ role: "user", content: "Write a long story." }], max_tokens: c.maxTokens };
      if (c.stream) {
        for await (const chunk of await client.chat.completions.create({ ...req, stream: true })) {
          finish = chunk.choices?.[0]?.finish_reason ?? finish;
        }
      } else {
        finish = (await client.chat.completions.create(req)).choices[0].finish_reason;
      }
    } else if (c.sdk === "anthropic") {
      const client = new Anthropic({ baseURL: c.base, apiKey: c.key, defaultHeaders: headers });
      const req = { model: "claude-sonnet-4-5", max_tokens: c.maxTokens, messages: [{ role: "user", content: "Write a long story." }] };
      const m = c.stream ? await client.messages.stream(req).finalMessage() : await client.messages.create(req);
      finish = m.stop_reason;
    } else {
      const client = new GoogleGenAI({ apiKey: c.key, httpOptions: { baseUrl: c.base, headers } });
      const req = { model: "gemini-2.5-flash", contents: "Write a long story.", config: { maxOutputTokens: c.maxTokens } };
      if (c.stream) {
        for await (const chunk of await client.models.generateContentStream(req)) {
          finish = chunk.candidates?.[0]?.finishReason ?? finish;
        }
      } else {
        finish = (await client.models.generateContent(req)).candidates[0].finishReason;
      }
    }
    return { ok: true, status: 200, ms: Date.now() - t0, finish };
  } catch (e) {
    return { ok: false, status: e.status ?? 0, ms: Date.now() - t0, error: `${e.name}: ${e.message}` };
  }
}

const calls = JSON.parse(process.argv[2]);
for (const r of await Promise.all(calls.map(call))) console.log(JSON.stringify(r));
