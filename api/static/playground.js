// The streamq playground: a chat over the native api's SSE stream, and a live view of the workers
// (their load charted by playground-charts.js).
// Plain JS, no build step. EventSource cannot POST, so the stream is read from fetch()'s body.
// With tools, the chat goes through the OpenAI endpoint instead (playground-tools.js); in Responses
// mode, through background responses that survive a reload (playground-responses.js).
"use strict";

const $ = (id) => document.getElementById(id);
const KEY = "streamq.apiKey";  // sessionStorage: the key lives as long as the tab
const FINISHED = new Set(["done", "failed", "cancelled", "expired"]);
const CLUSTER_EVERY_MS = 2000;

const history = [];  // the conversation as sent to the model; kept here, sent whole each turn
let current = null;  // the generation in flight
let clusterTimer = 0;

function headers(extra = {}) {
  const key = sessionStorage.getItem(KEY);
  return key ? {...extra, Authorization: `Bearer ${key}`} : extra;
}

function askForKey(reason) {
  $("auth").hidden = false;
  $("auth-reason").textContent = reason;
}

async function errorText(response) {
  try {
    const body = await response.json();
    const detail = body.detail ?? body.error?.message ?? body;
    if (Array.isArray(detail)) {  // FastAPI's 422: one entry per invalid field
      return detail.map((e) => `${(e.loc || []).filter((p) => p !== "body").join(".")}: ${e.msg}`).join("; ");
    }
    return typeof detail === "string" ? detail : JSON.stringify(detail);
  } catch {
    return `${response.status} ${response.statusText}`;
  }
}

// Yields {event, id, data} per event of a text/event-stream body; data is parsed JSON. OpenAI's
// "[DONE]" ends the stream.
async function* sseEvents(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const event = {event: "message", id: null, data: ""};
      for (const raw of block.split("\n")) {
        const line = raw.endsWith("\r") ? raw.slice(0, -1) : raw;
        if (!line || line.startsWith(":")) continue;  // ":" lines are keepalives
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        let text = colon < 0 ? "" : line.slice(colon + 1);
        if (text.startsWith(" ")) text = text.slice(1);
        if (field === "data") event.data += (event.data ? "\n" : "") + text;
        else if (field === "event") event.event = text;
        else if (field === "id") event.id = text;
      }
      if (event.data === "[DONE]") return;
      if (event.data) yield {...event, data: JSON.parse(event.data)};
    }
  }
}

// ---- chat -------------------------------------------------------------------------------------

function addMessage(role, text) {
  const item = document.createElement("li");
  item.className = role;
  const label = document.createElement("span");
  label.className = "role";
  label.textContent = role;
  const body = document.createElement("span");
  body.className = "text";
  body.textContent = text;  // never innerHTML: model output is untrusted
  item.append(label, body);
  $("messages").append(item);
  $("messages").scrollTop = $("messages").scrollHeight;
  return item;
}

// Appends a token's text (a new text node: no re-render of the reply so far), and keeps the
// list scrolled to the end unless the reader scrolled up.
function appendText(item, text) {
  const list = $("messages");
  const atEnd = list.scrollHeight - list.scrollTop - list.clientHeight < 40;
  item.querySelector(".text").append(text);
  if (atEnd) list.scrollTop = list.scrollHeight;
}

function note(item, text) {
  const span = document.createElement("span");
  span.className = "note";
  span.textContent = text;
  item.append(span);
}

function setState(state) {
  document.body.dataset.state = state;
  $("state").textContent = state;
}

function showRequestId(id) {
  document.body.dataset.requestId = id || "";
  $("request-id").textContent = id || "–";
}

function showError(message) {
  $("error").hidden = !message;
  $("error").textContent = message || "";
}

function showStats(run) {
  $("tokens").textContent = String(run.tokens);
  // A held reply (a tool-format one, sent once it is whole) shows no first token's time.
  $("ttft").textContent = run.tokens && !run.held ? `${Math.round(run.firstAt - run.startedAt)} ms` : "–";
  // The decode rate (tokens after the first, over the time since it) once two arrived apart;
  // before that, or when all came in one read or were held, the rate over the whole request.
  const decodeS = (run.lastAt - run.firstAt) / 1000;
  const totalS = (run.lastAt - run.startedAt) / 1000;
  let rate = null;
  if (run.tokens > 1 && decodeS > 0.001 && !run.held) rate = (run.tokens - 1) / decodeS;
  else if (run.tokens && totalS > 0) rate = run.tokens / totalS;
  $("tps").textContent = rate === null ? "–" : rate.toFixed(1);
}

// A token (or, with `tokens` 0, a tool call's delta) arrived: the timings move on.
function arrived(run, tokens) {
  const now = performance.now();
  if (!run.firstAt) run.firstAt = now;
  run.lastAt = now;
  run.tokens += tokens;
  showStats(run);
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("clear").disabled = busy;
  $("stop").disabled = !busy;
}

function sampling() {
  const number = (id) => Number($(id).value);
  const params = {
    temperature: number("temperature"),
    top_p: number("top_p"),
    top_k: Math.trunc(number("top_k")),
    max_tokens: Math.trunc(number("max_tokens")),
  };
  if ($("ignore_eos").checked) params.ignore_eos = true;
  const schema = $("json_schema").value.trim();
  if (schema) {
    try {
      params.structured_outputs = {json: JSON.parse(schema)};
    } catch (error) {
      throw new Error(`JSON schema: not valid JSON (${error.message})`);
    }
  }
  return params;
}

// The native stream's events into the assistant's item; run.text is the reply.
async function readNative(response, run, answer) {
  run.id = response.headers.get("X-Request-Id");
  showRequestId(run.id);
  setState("queued");
  for await (const event of sseEvents(response.body)) {
    if (event.event === "token") {
      arrived(run, 1);
      run.text += event.data.text;
      appendText(answer, event.data.text);
      if (run.tokens === 1) setState("streaming");
    } else if (event.event === "status") {
      setState(event.data.status);
    } else if (event.event === "final") {
      $("finish").textContent = event.data.finish_reason || "–";
      if (event.data.error) showError(event.data.error);
      setState(event.data.status);
    }
  }
}

// The assistant's turn for the history, in OpenAI's form (tool_calls when it made any).
function assistantTurn(run) {
  return run.calls ? run.calls.turn(run.text) : {role: "assistant", content: run.text};
}

async function send(text) {
  const system = $("system").value.trim();
  const images = takeAttachments();
  const turn = {role: "user", content: userContent(text, images)};
  const messages = [...(system ? [{role: "system", content: system}] : []), ...history, turn];
  const asked = addMessage("user", text);
  showImages(asked, images);
  const answer = addMessage("assistant", "");
  const run = {id: null, controller: new AbortController(), stopped: false, text: "", tokens: 0, calls: null,
               held: false, startedAt: performance.now(), firstAt: 0, lastAt: 0};
  current = run;
  setBusy(true);
  showError("");
  showRequestId(null);
  setState("sending");
  for (const id of ["ttft", "tps", "tokens", "finish"]) $(id).textContent = "–";
  try {
    if (responsesOn()) {
      if (images.length) throw new Error("images go with the chat API: turn the Responses mode off to send them");
      await sendResponse(text, run, answer);
      return;
    }
    const tools = toolsChosen();  // null: the native api, unless the conversation has images
    if (tools) {
      run.calls = new ToolCalls(answer);
      run.held = tools.tool_choice !== "none";  // the api parses a tool-format reply whole, then sends it
    }
    const chat = tools || hasImages(messages);  // the native api's messages are text
    const [path, body] = chat ? ["v1/chat/completions", chatBody(messages, sampling(), tools || {})]
      : ["v1/requests", {messages: messages.map(nativeMessage), ...sampling(), stream: true}];
    const response = await fetch(path, {
      method: "POST",
      headers: headers({"Content-Type": "application/json", Accept: "text/event-stream"}),
      body: JSON.stringify(body),
      signal: run.controller.signal,
    });
    if (!response.ok) {
      const reason = await errorText(response);
      if (response.status === 401) askForKey(reason);
      throw new Error(reason);
    }
    await (chat ? readChat : readNative)(response, run, answer);
    history.push(turn, assistantTurn(run));
  } catch (error) {
    if (run.stopped) {
      note(answer, "(stopped)");
      history.push(turn, assistantTurn(run));
      if (run.responseId) await stopResponse(run);
      else if (run.id) await settle(run.id);
      else setState("stopped");
    } else {  // nothing was said: take the turn back so it can be edited and resent
      asked.remove();
      answer.remove();
      $("prompt").value = text;
      restoreAttachments(images);
      showError(error.message);
      setState("error");
    }
  } finally {
    current = null;
    setBusy(false);
  }
}

// Stop: closing the stream cancels the request on the server; the DELETE says so explicitly,
// and covers a proxy that keeps the upstream connection open (409 means it had already ended).
// The OpenAI path has no request id to delete: there the closed stream alone cancels. A
// background response is cancelled by its own call, once the stream is closed (stopResponse).
function stop() {
  const run = current;
  if (!run || run.stopped) return;
  run.stopped = true;
  setState("stopping");
  run.controller.abort();
  if (run.id) {
    fetch(`v1/requests/${encodeURIComponent(run.id)}`, {method: "DELETE", headers: headers()}).catch(() => {});
  }
}

// After a stop, show how the request really ended (a running one stops within one step).
async function settle(id) {
  for (let i = 0; i < 6; i++) {
    try {
      const response = await fetch(`v1/requests/${encodeURIComponent(id)}?wait=5`, {headers: headers()});
      if (!response.ok) break;
      const state = await response.json();
      $("tokens").textContent = String(state.completion_tokens);
      $("finish").textContent = state.finish_reason || "–";
      if (FINISHED.has(state.status)) {
        setState(state.status);
        return;
      }
    } catch {
      break;
    }
  }
  setState("stopped");
}

// ---- workers panel ----------------------------------------------------------------------------

function cell(text, title) {
  const td = document.createElement("td");
  td.textContent = text;
  if (title) td.title = title;
  return td;
}

function renderCluster(cluster) {
  $("model").textContent = cluster.model;
  $("queue-waiting").textContent = String(cluster.queue.waiting);
  const rows = [...cluster.workers].sort((a, b) => String(a.worker).localeCompare(String(b.worker))).map((w) => {
    const row = document.createElement("tr");
    row.dataset.worker = w.worker;
    const kv = w.kv_blocks_free == null ? "–" : `${w.kv_blocks_free}/${w.kv_blocks_total ?? "?"}`;
    row.append(cell(w.worker), cell(w.model), cell(w.backend),
               cell(`${w.running}/${w.capacity}`, `${w.waiting ?? 0} waiting in the worker`),
               cell(kv, "free KV-cache blocks / all"));
    return row;
  });
  $("workers").replaceChildren(...rows);
  $("cluster-error").hidden = true;
  recordLoad(cluster);  // playground-charts.js
}

function clusterError(message) {
  $("cluster-error").hidden = false;
  $("cluster-error").textContent = message;
}

async function pollCluster() {
  clearTimeout(clusterTimer);
  try {
    const response = await fetch("v1/cluster", {headers: headers()});
    if (response.status === 401) {
      const reason = await errorText(response);
      askForKey(reason);
      clusterError(reason);
    } else if (!response.ok) {
      clusterError(await errorText(response));
    } else {
      renderCluster(await response.json());
    }
  } catch (error) {
    clusterError(`the api does not answer (${error.message})`);
  }
  clusterTimer = setTimeout(pollCluster, CLUSTER_EVERY_MS);
}

// ---- wiring -----------------------------------------------------------------------------------

document.addEventListener("DOMContentLoaded", () => {
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || current) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", stop);
  $("clear").addEventListener("click", () => {
    history.length = 0;
    forgetResponses();
    $("messages").replaceChildren();
    showError("");
    showRequestId(null);
    setState("idle");
  });
  $("auth").addEventListener("submit", (event) => {
    event.preventDefault();
    const key = $("api-key").value.trim();
    if (key) sessionStorage.setItem(KEY, key);
    else sessionStorage.removeItem(KEY);
    $("auth").hidden = true;
    showError("");
    pollCluster();
  });
  initImages();
  pollCluster();
  resumeResponse();
});
