// The npm `openai` SDK, unchanged, against a ragserve gateway: chat, completions, streaming (with usage),
// n=2, logprobs/top_logprobs and seed. Prints one JSON object with what it got; exits non-zero (with the reason
// on stderr) when the SDK raises or a reply lacks what the OpenAI API promises. tests/gateway_api/test_node_sdk.py
// starts the gateway, runs this with OPENAI_BASE_URL / OPENAI_API_KEY / RAGSERVE_MODEL set, and compares the
// texts with the worker's own gRPC replies.
import assert from "node:assert/strict";
import OpenAI from "openai";

const model = process.env.RAGSERVE_MODEL;
const client = new OpenAI({ timeout: 120_000, maxRetries: 0 }); // OPENAI_BASE_URL, OPENAI_API_KEY
const messages = [{ role: "user", content: process.env.RAGSERVE_PROMPT ?? "Write a Python function that adds two numbers." }];
const maxTokens = Number(process.env.RAGSERVE_MAX_TOKENS ?? "12");
const out = {};

function checkUsage(usage) {
  assert.ok(usage, "usage missing");
  assert.ok(usage.prompt_tokens > 0 && usage.completion_tokens > 0, JSON.stringify(usage));
  assert.equal(usage.total_tokens, usage.prompt_tokens + usage.completion_tokens);
}

// Chat, greedy.
const chat = await client.chat.completions.create({ model, messages, max_tokens: maxTokens, temperature: 0 });
assert.equal(chat.object, "chat.completion");
assert.equal(chat.choices.length, 1);
assert.equal(chat.choices[0].message.role, "assistant");
assert.ok(["stop", "length"].includes(chat.choices[0].finish_reason), chat.choices[0].finish_reason);
checkUsage(chat.usage);
out.chat = { text: chat.choices[0].message.content, finish_reason: chat.choices[0].finish_reason, usage: chat.usage };

// Completions, greedy.
const prompt = process.env.RAGSERVE_CODE_PROMPT ?? "def fibonacci(n):\n";
const completion = await client.completions.create({ model, prompt, max_tokens: maxTokens, temperature: 0 });
assert.equal(completion.object, "text_completion");
checkUsage(completion.usage);
out.completion = { text: completion.choices[0].text, finish_reason: completion.choices[0].finish_reason };

// Streaming chat with usage in the last chunk; the SDK ends the iteration at `data: [DONE]`.
const stream = await client.chat.completions.create({
  model, messages, max_tokens: maxTokens, temperature: 0, stream: true, stream_options: { include_usage: true },
});
let streamed = "";
let chunks = 0;
let usage = null;
let finish = null;
for await (const chunk of stream) {
  chunks += 1;
  assert.equal(chunk.object, "chat.completion.chunk");
  if (chunk.usage) usage = chunk.usage;
  for (const c of chunk.choices) {
    streamed += c.delta?.content ?? "";
    if (c.finish_reason) finish = c.finish_reason;
  }
}
checkUsage(usage);
assert.ok(finish, "no finish_reason in the stream");
out.stream = { text: streamed, chunks, finish_reason: finish, usage };

// n=2, sampled with a seed: two choices with indexes 0 and 1.
const two = await client.chat.completions.create({
  model, messages, max_tokens: maxTokens, temperature: 0.9, seed: 7, n: 2,
});
assert.deepEqual(two.choices.map((c) => c.index).sort(), [0, 1]);
out.n2 = two.choices.map((c) => c.message.content);

// Seed: the same seed gives the same sample; the SDK passes it through unchanged.
const seeded = [];
for (const seed of [1234, 1234]) {
  const r = await client.chat.completions.create({ model, messages, max_tokens: maxTokens, temperature: 1.0, seed });
  seeded.push(r.choices[0].message.content);
}
assert.equal(seeded[0], seeded[1], "the same seed gave different samples");
out.seed = seeded[0];

// Logprobs: one entry per generated token, top_logprobs alternatives, the chosen token among them.
const lp = await client.chat.completions.create({
  model, messages, max_tokens: maxTokens, temperature: 0, logprobs: true, top_logprobs: 3,
});
const content = lp.choices[0].logprobs?.content;
assert.ok(Array.isArray(content) && content.length === lp.usage.completion_tokens,
  `logprobs.content has ${content?.length} entries for ${lp.usage.completion_tokens} tokens`);
for (const t of content) {
  assert.ok(t.logprob <= 0, JSON.stringify(t));
  assert.equal(t.top_logprobs.length, 3);
  assert.ok(t.top_logprobs[0].logprob >= t.logprob - 1e-4, "greedy: the chosen token is the most likely one");
}
assert.equal(content.map((t) => t.token).join(""), lp.choices[0].message.content);
out.logprobs = content.map((t) => ({ token: t.token, logprob: t.logprob, top: t.top_logprobs.map((a) => a.token) }));

process.stdout.write(JSON.stringify(out) + "\n");
