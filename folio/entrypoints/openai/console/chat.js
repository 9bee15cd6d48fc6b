// The chat playground: a conversation streamed from /v1/chat/completions.
import { errorMessage, fetchJSON, readSSE } from "./api.js";

const $ = (id) => document.getElementById(id);

const conversation = [];        // {role, content} turns sent with every request
let controller = null;          // the AbortController of the answer being streamed

export async function initChat() {
  $("chat-form").addEventListener("submit", (event) => { event.preventDefault(); send(); });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("chat-form").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => { if (controller) controller.abort(); });
  $("clear").addEventListener("click", () => {
    if (controller) controller.abort();
    conversation.length = 0;
    $("messages").replaceChildren();
    setStatus("");
  });
  await loadModels();
}

async function loadModels() {
  const select = $("model");
  try {
    const models = await fetchJSON("/v1/models");
    select.replaceChildren(...models.data.map((model) => new Option(model.id, model.id)));
    if (models.data.length) $("server-model").textContent = models.data[0].id;
  } catch (error) {
    setStatus(`could not list the models: ${error.message}`, true);
  }
}

function setStatus(text, isError = false) {
  const status = $("chat-status");
  status.textContent = text;
  status.classList.toggle("error", isError);
}

function addMessage(role, text) {
  const message = document.createElement("div");
  message.className = `message ${role}`;
  const label = document.createElement("div");
  label.className = "role";
  label.textContent = role;
  const reasoning = document.createElement("div");
  reasoning.className = "reasoning";
  const content = document.createElement("div");
  content.className = "content";
  content.textContent = text;  // text, never HTML: answers are shown as written
  const meta = document.createElement("div");
  meta.className = "meta";
  message.append(label, reasoning, content, meta);
  $("messages").append(message);
  message.scrollIntoView({ block: "end" });
  return message;
}

function numberField(id) {
  const value = $(id).value.trim();
  return value === "" ? undefined : Number(value);
}

// The request as the settings say; fields left empty are left to the server's defaults.
function buildRequest() {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...conversation);
  const request = {
    model: $("model").value || undefined,
    messages,
    stream: true,
    stream_options: { include_usage: true },
    temperature: numberField("temperature"),
    top_p: numberField("top-p"),
    max_tokens: numberField("max-tokens"),
    seed: numberField("seed"),
  };
  if ($("json-mode").checked) request.response_format = { type: "json_object" };
  return request;
}

async function send() {
  const prompt = $("prompt");
  const text = prompt.value.trim();
  if (!text || controller) return;
  prompt.value = "";
  conversation.push({ role: "user", content: text });
  addMessage("user", text);
  const jsonMode = $("json-mode").checked;
  const message = addMessage("assistant", "");
  const content = message.querySelector(".content");
  const reasoning = message.querySelector(".reasoning");
  message.dataset.state = "streaming";
  message.dataset.chunks = "0";
  setStatus("");
  controller = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  const started = performance.now();
  let firstToken = null;
  let finishReason = null;
  let usage = null;
  let answer = "";
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(buildRequest()),
      signal: controller.signal,
    });
    if (!response.ok) throw new Error(await errorMessage(response));
    for await (const data of readSSE(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message || "the stream failed");
      if (chunk.usage) usage = chunk.usage;
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) continue;
      const delta = choice.delta || {};
      const thinking = delta.reasoning_content || delta.reasoning;
      if (thinking) reasoning.textContent += thinking;
      if (delta.content) {
        if (firstToken === null) firstToken = performance.now();
        answer += delta.content;
        content.textContent = answer;
        message.dataset.chunks = String(Number(message.dataset.chunks) + 1);
        message.scrollIntoView({ block: "end" });
      }
      if (choice.finish_reason) finishReason = choice.finish_reason;
    }
    message.dataset.state = "done";
  } catch (error) {
    if (error.name === "AbortError") {
      message.dataset.state = "stopped";
    } else {
      message.dataset.state = "error";
      setStatus(error.message, true);
    }
  } finally {
    controller = null;
    $("send").disabled = false;
    $("stop").disabled = true;
  }
  // A stopped answer stays in the conversation as far as it got; a failed one does not.
  if (message.dataset.state !== "error") conversation.push({ role: "assistant", content: answer });
  else conversation.pop();
  message.querySelector(".meta").textContent = describe({
    state: message.dataset.state, finishReason, usage, jsonMode, answer,
    seconds: (performance.now() - started) / 1000,
    ttft: firstToken === null ? null : (firstToken - started) / 1000,
  });
  if (jsonMode && message.dataset.state === "done") {
    message.dataset.json = isJSON(answer) ? "valid" : "invalid";
  }
}

function isJSON(text) {
  try { JSON.parse(text); return true; } catch (_) { return false; }
}

// The line under an answer: how it ended and what it took, as this browser saw it.
function describe({ state, finishReason, usage, jsonMode, answer, seconds, ttft }) {
  const parts = [];
  if (state === "stopped") parts.push("stopped");
  else if (finishReason) parts.push(`finish: ${finishReason}`);
  if (usage) parts.push(`${usage.prompt_tokens} prompt + ${usage.completion_tokens} completion tokens`);
  if (ttft !== null) parts.push(`first token ${ttft.toFixed(2)} s`);
  parts.push(`${seconds.toFixed(2)} s`);
  if (jsonMode && state === "done") parts.push(isJSON(answer) ? "valid JSON" : "not valid JSON");
  return parts.join(" · ");
}
