// The playground's tool calling: with a tools array in the Tools field, the chat goes through
// /v1/chat/completions (tools exist only there), streamed, and the reply's tool calls show as
// blocks in the assistant's turn. Uses playground.js's helpers ($, sseEvents, arrived, ...).
"use strict";

// {tools, tool_choice} to send, or null when the Tools field is empty (the native api then).
function toolsChosen() {
  const text = $("tools").value.trim();
  if (!text) return null;
  try {
    return {tools: JSON.parse(text), tool_choice: $("tool_choice").value};
  } catch (error) {
    throw new Error(`Tools: not valid JSON (${error.message})`);
  }
}

// The chat completions body: the page's sampling settings all have a field of the same name
// there (top_k and ignore_eos as vLLM's extras, the JSON schema as structured_outputs).
function chatBody(messages, params, tools) {
  return {messages, ...params, ...tools, stream: true, stream_options: {include_usage: true}};
}

// A history message for the native api, whose messages are text: an assistant's tool calls as
// the model wrote them, in the generic format of api/tools.py.
function nativeMessage(message) {
  if (!message.tool_calls) return {role: message.role, content: message.content ?? ""};
  const calls = message.tool_calls.map(({function: f}) => {
    try {
      return {name: f.name, arguments: JSON.parse(f.arguments)};
    } catch {
      return {name: f.name, arguments: f.arguments};  // cut short by Stop or max_tokens
    }
  });
  return {role: "assistant", content: JSON.stringify({tool_calls: calls})};
}

// The chunks of a chat completions stream into the assistant's item: content as it comes, tool
// calls through run.calls. The api sends a tool reply's deltas once it is whole.
async function readChat(response, run, answer) {
  setState("queued");
  let finished = null;  // shown once the stream has ended: the usage chunk comes after the finish reason
  for await (const {data: chunk} of sseEvents(response.body)) {
    if (chunk.id && !document.body.dataset.requestId) showRequestId(chunk.id);
    for (const choice of chunk.choices || []) {
      const delta = choice.delta || {};
      if (delta.content) {
        arrived(run, 1);
        run.text += delta.content;
        appendText(answer, delta.content);
      }
      for (const call of delta.tool_calls || []) {
        arrived(run, 0);
        run.calls.add(call);
      }
      if (run.firstAt && document.body.dataset.state === "queued") setState("streaming");
      if (choice.finish_reason) finished = choice.finish_reason;
    }
    if (chunk.usage) {  // the last chunk: the true token count (a tool reply's deltas are not tokens)
      run.tokens = chunk.usage.completion_tokens;
      showStats(run);
    }
  }
  if (finished) showFinish(finished);
}

function showFinish(reason) {
  $("finish").textContent = reason;
  if (reason === "error") showError("the generation failed (the api's log says why)");
  setState({error: "failed", abort: "cancelled"}[reason] || "done");
}

// One reply's tool calls, assembled from the stream's deltas by index, each shown as a block:
// the function's name and its arguments, pretty-printed once they parse as JSON.
class ToolCalls {
  constructor(item) {
    this.item = item;
    this.calls = [];
  }

  add(delta) {
    let call = this.calls[delta.index];
    if (!call) {
      call = this.calls[delta.index] = {id: null, name: "", arguments: "", block: toolBlock()};
      this.item.append(call.block);
    }
    call.id = delta.id || call.id;
    call.name += delta.function?.name || "";
    call.arguments += delta.function?.arguments || "";
    call.block.dataset.name = call.name;
    call.block.querySelector(".tool-name").textContent = call.name;
    call.block.querySelector(".tool-arguments").textContent = pretty(call.arguments);
  }

  // The assistant's turn in OpenAI's form, to send back with the history.
  turn(text) {
    const calls = this.calls.filter(Boolean).map((c) => ({id: c.id, type: "function",
                                                           function: {name: c.name, arguments: c.arguments}}));
    return calls.length ? {role: "assistant", content: text || null, tool_calls: calls}
      : {role: "assistant", content: text};
  }
}

function toolBlock() {
  const block = document.createElement("div");
  block.className = "tool-call";
  const name = document.createElement("span");
  name.className = "tool-name";
  const args = document.createElement("pre");
  args.className = "tool-arguments";
  block.append(name, args);
  return block;
}

function pretty(json) {
  try {
    return JSON.stringify(JSON.parse(json), null, 2);
  } catch {
    return json;  // not whole yet
  }
}
