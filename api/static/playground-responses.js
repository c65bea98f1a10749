// The playground's Responses mode: each turn is a background response of /v1/responses, continued
// by previous_response_id (the server keeps the conversation), and its stream is followed from the
// last sequence number seen, which the tab keeps: reloading the page resumes the reply where it
// was. Uses playground.js's helpers ($, sseEvents, arrived, appendText, ...).
"use strict";

const RESPONSES = "streamq.responses";  // sessionStorage: {previous, pending: {id, prompt, text, seq}}
const ENDED = new Set(["completed", "incomplete", "failed", "cancelled"]);

function responsesOn() {
  return $("responses-mode").checked;
}

function responsesState() {
  try {
    return JSON.parse(sessionStorage.getItem(RESPONSES)) || {};
  } catch {
    return {};
  }
}

function saveResponses(state) {
  sessionStorage.setItem(RESPONSES, JSON.stringify(state));
}

// The page's settings as a Responses body; those the Responses API has no field for are refused
// here, with the reason, rather than dropped.
function responseBody(text, params) {
  if (params.top_k !== -1 || params.ignore_eos) {
    throw new Error("Responses mode: top k and ignore end of sequence are not Responses API fields");
  }
  if (toolsChosen()) throw new Error("Responses mode: tools go through the chat mode here");
  const body = {input: text, background: true, temperature: params.temperature, top_p: params.top_p,
                max_output_tokens: params.max_tokens};
  const system = $("system").value.trim();
  if (system) body.instructions = system;
  const previous = responsesState().previous;
  if (previous) body.previous_response_id = previous;
  if (params.structured_outputs) {
    body.text = {format: {type: "json_schema", name: "reply", schema: params.structured_outputs.json}};
  }
  return body;
}

function showResponse(run) {
  document.body.dataset.responseId = run.responseId || "";
  showRequestId(run.responseId);
}

// Creates the background response, then follows it.
async function sendResponse(text, run, answer) {
  const reply = await fetch("v1/responses", {
    method: "POST",
    headers: headers({"Content-Type": "application/json"}),
    body: JSON.stringify(responseBody(text, sampling())),
    signal: run.controller.signal,
  });
  if (!reply.ok) {
    const reason = await errorText(reply);
    if (reply.status === 401) askForKey(reason);
    throw new Error(reason);
  }
  const created = await reply.json();
  run.responseId = created.id;
  run.prompt = text;
  run.seq = -1;
  showResponse(run);
  setState(created.status);
  saveResponses({...responsesState(), pending: {id: created.id, prompt: text, text: "", seq: -1}});
  await followResponse(run, answer);
}

// The response's events after run.seq into the assistant's item; each one's number and the text
// so far are kept in the tab, so a reload goes on from there.
async function followResponse(run, answer) {
  const after = run.seq >= 0 ? `&starting_after=${run.seq}` : "";
  const reply = await fetch(`v1/responses/${encodeURIComponent(run.responseId)}?stream=true${after}`, {
    headers: headers({Accept: "text/event-stream"}),
    signal: run.controller.signal,
  });
  if (!reply.ok) throw new Error(await errorText(reply));
  let status = null;
  for await (const {data} of sseEvents(reply.body)) {
    if (data.type === "response.in_progress") {
      setState("in_progress");
    } else if (data.type === "response.output_text.delta") {
      arrived(run, 1);
      run.text += data.delta;
      appendText(answer, data.delta);
      setState("streaming");
    } else if (data.response && ENDED.has(data.response.status)) {
      status = data.response.status;
      ended(run, data.response);
    }
    run.seq = data.sequence_number;
    if (!status) {
      saveResponses({...responsesState(), pending: {id: run.responseId, prompt: run.prompt, text: run.text,
                                                     seq: run.seq}});
    }
  }
  if (!status) {  // a cancelled response's stream ends with no final event: ask how it ended
    const state = await fetch(`v1/responses/${encodeURIComponent(run.responseId)}`, {headers: headers()});
    if (state.ok) ended(run, await state.json());
  }
}

function ended(run, response) {
  $("finish").textContent = response.incomplete_details?.reason || response.status;
  if (response.usage) $("tokens").textContent = String(response.usage.output_tokens);
  if (response.error) showError(response.error.message);
  const finished = response.status === "completed" || response.status === "incomplete";
  saveResponses({previous: finished ? response.id : responsesState().previous, pending: null});
  setState(response.status);
}

// Stop: cancel the background response on the server (closing the stream alone would not).
async function stopResponse(run) {
  const reply = await fetch(`v1/responses/${encodeURIComponent(run.responseId)}/cancel`,
                            {method: "POST", headers: headers()});
  if (reply.ok) ended(run, await reply.json());
  else setState("stopped");
}

// After a reload: the reply that was on its way is shown as far as it came, and followed on.
async function resumeResponse() {
  const pending = responsesState().pending;
  if (!pending) return;
  $("responses-mode").checked = true;
  addMessage("user", pending.prompt);
  const answer = addMessage("assistant", pending.text);
  const run = {responseId: pending.id, prompt: pending.prompt, seq: pending.seq, text: pending.text,
               controller: new AbortController(), stopped: false, tokens: 0, calls: null, held: false,
               startedAt: performance.now(), firstAt: 0, lastAt: 0};
  current = run;
  setBusy(true);
  showResponse(run);
  setState("resuming");
  try {
    await followResponse(run, answer);
  } catch (error) {
    if (run.stopped) {
      note(answer, "(stopped)");
      await stopResponse(run);
    } else {
      showError(error.message);
      setState("error");
    }
  } finally {
    current = null;
    setBusy(false);
  }
}

function forgetResponses() {
  sessionStorage.removeItem(RESPONSES);
}
