// dflash's built-in page: a chat playground and a live view of what speculation does.
// Plain browser JavaScript, no build step, no network but this server. The API key (when the
// server needs one) is kept in sessionStorage: this tab only, never in the page itself.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { key: sessionStorage.getItem("dflash-api-key") || "", history: [], live: null, busy: false };

function headers(extra = {}) {
  const h = { ...extra };
  if (state.key) h["Authorization"] = "Bearer " + state.key;
  return h;
}

async function api(path, options = {}) {
  const response = await fetch(path, { ...options, headers: headers(options.headers) });
  if (response.status === 401) {
    $("key-box").hidden = false;
    $("status").textContent = "needs the API key";
    throw new Error("the server needs its API key");
  }
  return response;
}

function setStatus(text) { $("status").textContent = text; }

// ------------------------------------------------------------------ models and key
async function loadModels() {
  const response = await api("/v1/models");
  const models = (await response.json()).data || [];
  const select = $("model");
  select.replaceChildren(...models.map((m) => new Option(m.id, m.id)));
  $("key-box").hidden = true;
  setStatus(models.length ? `${models.length} model${models.length > 1 ? "s" : ""}` : "no models");
}

$("key-save").addEventListener("click", async () => {
  state.key = $("api-key").value.trim();
  sessionStorage.setItem("dflash-api-key", state.key);
  $("key-error").textContent = "";
  try { await loadModels(); } catch (e) { $("key-error").textContent = "that key was refused"; }
});

// ------------------------------------------------------------------ tabs
for (const tab of document.querySelectorAll(".tab")) {
  tab.addEventListener("click", () => {
    for (const t of document.querySelectorAll(".tab")) t.classList.toggle("active", t === tab);
    $("view-chat").hidden = tab.dataset.view !== "chat";
    $("view-live").hidden = tab.dataset.view !== "live";
    if (tab.dataset.view === "live") refreshLive();
  });
}

// ------------------------------------------------------------------ playground
function addMessage(role, text = "") {
  const box = document.createElement("div");
  box.className = "message " + role;
  const reasoning = document.createElement("div");
  reasoning.className = "reasoning";
  const content = document.createElement("div");
  content.className = "content";
  content.textContent = text;
  const stats = document.createElement("div");
  stats.className = "stats";
  box.append(reasoning, content, stats);
  $("messages").append(box);
  return { box, reasoning, content, stats };
}

function statsLine(d) {
  const parts = [`${d.decode_tokens_per_second.toFixed(1)} tok/s`];
  if (d.speculative && d.cycles) parts.push(`${d.tokens_per_cycle.toFixed(2)} tokens/cycle over ${d.cycles} cycles`);
  else if (!d.speculative) parts.push(`speculation off: ${d.speculative_off_reason}`);
  if (d.plain_steps) parts.push(`${d.plain_steps} plain steps`);
  parts.push(`prefill ${d.prefill_seconds.toFixed(2)} s, decode ${d.decode_seconds.toFixed(2)} s`);
  parts.push(`${d.prompt_tokens - d.prefill_tokens} of ${d.prompt_tokens} prompt tokens cached`);
  return parts.join(" · ");
}

function requestBody(text) {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...state.history, { role: "user", content: text });
  const body = { model: $("model").value, messages, stream: true, stream_options: { include_usage: true },
                 temperature: Number($("temperature").value), max_tokens: Number($("max-tokens").value) };
  const stop = $("stop").value.split(",").map((s) => s.trim()).filter(Boolean);
  if (stop.length) body.stop = stop;
  if ($("speculation").value) body.dflash = { speculation: $("speculation").value };
  return body;
}

async function send(text) {
  state.busy = true;
  $("send").disabled = true;
  addMessage("user", text);
  const out = addMessage("assistant");
  let answer = "";
  try {
    const response = await api("/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(requestBody(text)) });
    if (!response.ok) {
      const error = await response.json().catch(() => ({}));
      throw new Error((error.error && error.error.message) || `HTTP ${response.status}`);
    }
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");  // SSE allows CRLF
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
          const chunk = JSON.parse(line.slice(6));
          if (chunk.error) throw new Error(chunk.error.message);
          const delta = (chunk.choices && chunk.choices[0] && chunk.choices[0].delta) || {};
          if (delta.reasoning_content) out.reasoning.textContent += delta.reasoning_content;
          if (delta.content) { answer += delta.content; out.content.textContent = answer; }
          if (chunk.dflash) out.stats.textContent = statsLine(chunk.dflash);
        }
      }
    }
    state.history.push({ role: "user", content: text }, { role: "assistant", content: answer });
  } catch (e) {
    out.stats.textContent = "";
    out.content.classList.add("error");
    out.content.textContent = (answer ? answer + "\n" : "") + "error: " + e.message;
  } finally {
    state.busy = false;
    $("send").disabled = false;
  }
}

$("send-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("input").value.trim();
  if (!text || state.busy) return;
  $("input").value = "";
  send(text);
});
$("input").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) { event.preventDefault(); $("send-form").requestSubmit(); }
});
$("clear").addEventListener("click", () => { state.history = []; $("messages").replaceChildren(); });

// ------------------------------------------------------------------ live view
function canvasContext(canvas) {
  const ratio = window.devicePixelRatio || 1;
  canvas.width = canvas.clientWidth * ratio;
  canvas.height = canvas.clientHeight * ratio;
  const ctx = canvas.getContext("2d");
  ctx.scale(ratio, ratio);
  return [ctx, canvas.clientWidth, canvas.clientHeight];
}

function drawAxes(ctx, w, h, label, top) {
  ctx.fillStyle = "#6b7385";
  ctx.font = "11px system-ui, sans-serif";
  ctx.fillText(label, 4, 12);
  ctx.fillText(top, w - ctx.measureText(top).width - 4, 12);
  ctx.strokeStyle = "#dfe3ea";
  ctx.beginPath(); ctx.moveTo(0, h - 0.5); ctx.lineTo(w, h - 0.5); ctx.stroke();
}

function drawRate(canvas, values) {
  const [ctx, w, h] = canvasContext(canvas);
  const top = Math.max(1, ...values);
  drawAxes(ctx, w, h, "tok/s, last 5 min (10 s steps)", top.toFixed(1));
  ctx.strokeStyle = "#2f6fed";
  ctx.lineWidth = 2;
  ctx.beginPath();
  values.forEach((v, i) => {
    const x = (i / Math.max(1, values.length - 1)) * w;
    const y = h - 4 - (v / top) * (h - 24);
    if (i) ctx.lineTo(x, y); else ctx.moveTo(x, y);
  });
  ctx.stroke();
}

function drawAcceptance(canvas, values) {
  const [ctx, w, h] = canvasContext(canvas);
  drawAxes(ctx, w, h, "acceptance by block position", "1.0");
  const n = Math.max(1, values.length);
  const bar = w / n;
  values.forEach((v, i) => {
    const height = (v || 0) * (h - 24);
    ctx.fillStyle = "#2f6fed";
    ctx.fillRect(i * bar + 2, h - 1 - height, bar - 4, height);
    ctx.fillStyle = "#6b7385";
    ctx.fillText(String(i + 1), i * bar + bar / 2 - 3, h - 3 - height - 2);
  });
}

const percent = (x) => (x === null || x === undefined ? "–" : (100 * x).toFixed(0) + " %");
const number = (x, digits = 2) => (x === null || x === undefined ? "–" : x.toFixed(digits));
const megabytes = (b) => (b / 1e6).toFixed(0) + " MB";

function modelPanel(name, m) {
  const panel = document.createElement("section");
  panel.className = "card model-live";
  panel.dataset.model = name;
  const numbers = document.createElement("div");
  numbers.className = "numbers";
  numbers.innerHTML = "";
  const title = document.createElement("h2");
  title.textContent = name;
  numbers.append(title);
  for (const [label, value] of [["requests", String(m.requests)], ["tokens", String(m.generated_tokens)],
    ["tokens per cycle", number(m.tokens_per_cycle)], ["tokens from cycles", percent(m.share_from_cycles)],
    ["plain steps", String(m.plain_steps)], ["prefix-cache hits", percent(m.prefix_cache_hit_rate)]]) {
    const item = document.createElement("span");
    item.append(label + " ");
    const b = document.createElement("b");
    b.textContent = value;
    b.className = "value-" + label.replaceAll(" ", "-");
    item.append(b);
    numbers.append(item);
  }
  const rate = document.createElement("canvas");
  const acceptance = document.createElement("canvas");
  panel.append(numbers, rate, acceptance);
  return [panel, () => { drawRate(rate, m.tokens_per_second); drawAcceptance(acceptance, m.acceptance_by_position); }];
}

async function refreshLive() {
  if ($("view-live").hidden) return;
  try {
    const live = await (await api("/v1/dflash/live")).json();
    $("live-active").textContent = live.active_requests;
    $("live-queued").textContent = live.queued_requests;
    $("live-cache").textContent = `${megabytes(live.memory.prefix_cache_bytes)} of ${megabytes(live.memory.prefix_cache_budget_bytes)}`;
    $("live-memory").textContent = megabytes(live.memory.active_bytes);
    const panels = Object.entries(live.models).map(([name, m]) => modelPanel(name, m));
    $("live-models").replaceChildren(...panels.map(([panel]) => panel));
    for (const [, draw] of panels) draw();
    if (!panels.length) $("live-models").textContent = "No generation has finished yet.";
  } catch (e) {
    setStatus(e.message);
  }
}

async function start() {
  const config = await (await fetch("/page/config")).json();
  if (config.api_key_required && !state.key) {
    $("key-box").hidden = false;
    setStatus("needs the API key");
    return;
  }
  await loadModels();
}

setInterval(refreshLive, 2000);
start().catch((e) => setStatus(e.message));
