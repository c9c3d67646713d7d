// Axon playground: a chat page that uses only the public API, so it is also a worked example of
// it: /v1/models for the model picker, OpenAI's Conversations API for a chat's history (one
// conversation per chat, its title in `metadata`, its items read page by page) and OpenAI's
// Responses API for the answers (`POST /v1/responses` with `conversation` and `stream: true`).
// OpenAI has no "list conversations" endpoint: the sidebar lists GET /v1/sessions, an Axon
// extension (a conversation is a session: its id is `conv_` + the session's UUID in hex).
"use strict";

(() => {
  const KEY_STORAGE = "axon.apiKey";
  const SESSIONS_PAGE = 50;
  const ITEMS_PAGE = 100;
  const TITLE_CHARS = 60;

  const $ = (id) => document.getElementById(id);
  const state = {
    key: sessionStorage.getItem(KEY_STORAGE) || "",
    conversationId: null,
    lastSessionId: null, // `after` cursor of the next page of sessions, null when there is none
    generation: null, // the answer being streamed: {controller, responseId, stopping, stopped, status}
  };

  // --- the API --------------------------------------------------------------------------------

  class ApiError extends Error {
    constructor(status, message, retryAfterS) {
      super(message);
      this.status = status;
      this.retryAfterS = retryAfterS;
    }
  }

  async function apiError(response) {
    let message = response.statusText;
    try {
      const body = await response.json();
      message = (body.error && body.error.message) || message;
    } catch {
      // Not JSON (a proxy's error page, say): the status text says enough.
    }
    const retryAfter = response.headers.get("Retry-After");
    return new ApiError(response.status, message, retryAfter === null ? null : Number(retryAfter));
  }

  async function api(path, { method = "GET", body, signal } = {}) {
    const headers = { Authorization: `Bearer ${state.key}` };
    if (body !== undefined) headers["Content-Type"] = "application/json";
    const response = await fetch(path, {
      method, headers, signal, body: body === undefined ? undefined : JSON.stringify(body),
    });
    if (!response.ok) throw await apiError(response);
    return response;
  }

  async function apiJson(path, options) {
    return (await api(path, options)).json();
  }

  // Server-sent events from a fetch body, as each event's `data` text.
  async function* sseData(body) {
    const reader = body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value;
      let match;
      while ((match = /\r?\n\r?\n/.exec(buffer)) !== null) {
        const block = buffer.slice(0, match.index);
        buffer = buffer.slice(match.index + match[0].length);
        const data = block.split(/\r?\n/)
          .filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).replace(/^ /, ""))
          .join("\n");
        if (data) yield data;
      }
    }
  }

  // --- messages to the user -------------------------------------------------------------------

  function retryText(seconds) {
    return seconds === null || Number.isNaN(seconds) ? "Try again shortly." : `Try again in ${seconds} s.`;
  }

  function describe(error) {
    if (error instanceof ApiError) {
      switch (error.status) {
        case 401:
          return `The API key was refused (401): ${error.message} Enter a valid key.`;
        case 429:
          return `Rate limited (429): ${error.message} ${retryText(error.retryAfterS)}`;
        case 503:
          return `The service is unavailable (503): ${error.message} ${retryText(error.retryAfterS)}`;
        default:
          return `Request failed (${error.status}): ${error.message}`;
      }
    }
    if (error instanceof TypeError) return `The gateway could not be reached: ${error.message}`;
    return error.message;
  }

  function showAlert(text, kind = "error") {
    const alert = $("alert");
    alert.textContent = text;
    alert.className = `alert ${kind}`;
    alert.hidden = false;
  }

  function clearAlert() {
    $("alert").hidden = true;
    $("alert").textContent = "";
  }

  // --- rendering ------------------------------------------------------------------------------

  function renderMarkdown(element, text) {
    element.innerHTML = DOMPurify.sanitize(marked.parse(text));
  }

  // A JSON text as a value (objects and arrays only: a bare number or string reads fine as prose),
  // or undefined when it is not one (yet: a streamed answer is incomplete until its end).
  function jsonValue(text) {
    const trimmed = text.trim();
    if (!/^[[{]/.test(trimmed)) return undefined;
    try {
      return JSON.parse(trimmed);
    } catch {
      return undefined;
    }
  }

  // JSON shown legibly: pretty-printed in a monospace block once it parses, as it came until then.
  function jsonBlock(text) {
    const pre = document.createElement("pre");
    pre.className = "json";
    const value = jsonValue(text);
    pre.textContent = value === undefined ? text : JSON.stringify(value, null, 2);
    return pre;
  }

  // One tool call the model made: its function's name, then its arguments as JSON.
  function toolCallBlock(call) {
    const block = document.createElement("div");
    block.className = "tool-call";
    const title = document.createElement("div");
    title.className = "tool-name";
    title.textContent = call.name || "";
    if (call.id) title.title = call.id;
    block.append(title, jsonBlock(call.arguments || ""));
    return block;
  }

  // An assistant answer: its text (JSON pretty-printed when the answer is JSON, else markdown),
  // then its tool calls, each `{id, name, arguments}`.
  function renderAnswer(element, text, calls = [], { json = false } = {}) {
    if (json || jsonValue(text) !== undefined) element.replaceChildren(jsonBlock(text));
    else renderMarkdown(element, text);
    element.append(...calls.map(toolCallBlock));
  }

  function addMessage(role, text) {
    const article = document.createElement("article");
    article.className = `message ${role}`;
    const body = document.createElement("div");
    body.className = "body";
    const meta = document.createElement("div");
    meta.className = "meta";
    article.append(body, meta);
    if (role === "user") body.textContent = text;
    else if (role === "tool") body.replaceChildren(jsonBlock(text));
    else renderAnswer(body, text);
    $("messages").append(article);
    article.scrollIntoView({ block: "end" });
    return { article, body, meta };
  }

  function setGenerating(on) {
    $("send").disabled = on;
    $("stop").disabled = !on;
  }

  function seconds(ms) {
    return `${(ms / 1000).toFixed(2)} s`;
  }

  // Time to first token, and tokens/s over the generation (first token to last).
  function answerStats({ startedAt, firstAt, endedAt, usage, status }) {
    const parts = [];
    if (firstAt !== null) parts.push(`TTFT ${seconds(firstAt - startedAt)}`);
    if (usage) {
      const generatingS = firstAt === null ? 0 : (endedAt - firstAt) / 1000;
      const rate = usage.output_tokens > 1 && generatingS > 0 ? (usage.output_tokens - 1) / generatingS : null;
      parts.push(rate === null ? "— tokens/s" : `${rate.toFixed(1)} tokens/s`);
      parts.push(`${usage.output_tokens} tokens`);
    }
    if (status) parts.push(`status: ${status}`);
    return parts.join(" · ");
  }

  // --- sessions -------------------------------------------------------------------------------

  function sessionTitle(session) {
    return session.title || "Untitled";
  }

  // The conversation of a session listed by GET /v1/sessions: `conv_` + its UUID in hex.
  function conversationId(sessionId) {
    return `conv_${sessionId.replaceAll("-", "")}`;
  }

  function listedTitle(id) {
    const item = [...$("sessions").children].find((i) => i.dataset.id === id);
    return item ? item.querySelector(".open").textContent : null;
  }

  function sessionItem(session) {
    const item = document.createElement("li");
    item.className = "session";
    const id = conversationId(session.id);
    item.dataset.id = id;
    item.classList.toggle("active", id === state.conversationId);
    const open = document.createElement("button");
    open.type = "button";
    open.className = "open";
    open.textContent = sessionTitle(session);
    open.addEventListener("click", () => openConversation(id).catch((e) => showAlert(describe(e))));
    const rename = document.createElement("button");
    rename.type = "button";
    rename.className = "rename";
    rename.textContent = "Rename";
    rename.addEventListener("click", () => startRename(item, session));
    const remove = document.createElement("button");
    remove.type = "button";
    remove.className = "delete";
    remove.textContent = "Delete";
    remove.addEventListener("click", () => deleteConversation(id, session).catch((e) => showAlert(describe(e))));
    item.append(open, rename, remove);
    return item;
  }

  async function loadSessions({ more = false } = {}) {
    const query = new URLSearchParams({ limit: String(SESSIONS_PAGE) });
    if (more && state.lastSessionId) query.set("after", state.lastSessionId);
    const page = await apiJson(`/v1/sessions?${query}`);
    if (!more) $("sessions").replaceChildren();
    $("sessions").append(...page.data.map(sessionItem));
    state.lastSessionId = page.data.length ? page.data[page.data.length - 1].id : null;
    $("more-sessions").hidden = !page.has_more;
  }

  function startRename(item, session) {
    const open = item.querySelector(".open");
    const input = document.createElement("input");
    input.className = "title-input";
    input.maxLength = 200;
    input.value = session.title || "";
    input.setAttribute("aria-label", "New title");
    open.replaceWith(input);
    input.focus();
    input.select();
    let done = false;
    const finish = async (save) => {
      if (done) return;
      done = true;
      const title = input.value.trim();
      if (save && title && title !== session.title) {
        try {
          await apiJson(`/v1/conversations/${conversationId(session.id)}`, { method: "POST", body: { metadata: { title } } });
          // The session's title is what GET /v1/sessions lists (the Axon extension of the sidebar).
          Object.assign(session, await apiJson(`/v1/sessions/${session.id}`, { method: "PATCH", body: { title } }));
        } catch (error) {
          showAlert(describe(error));
        }
      }
      open.textContent = sessionTitle(session);
      input.replaceWith(open);
      if (conversationId(session.id) === state.conversationId) $("chat-title").textContent = sessionTitle(session);
    };
    input.addEventListener("keydown", (event) => {
      if (event.key === "Enter") finish(true);
      if (event.key === "Escape") finish(false);
    });
    input.addEventListener("blur", () => finish(true));
  }

  async function deleteConversation(id, session) {
    if (!confirm(`Delete "${sessionTitle(session)}" and all its messages?`)) return;
    await api(`/v1/conversations/${id}`, { method: "DELETE" });
    if (id === state.conversationId) newChat();
    await loadSessions();
  }

  function markActive() {
    for (const item of $("sessions").children) item.classList.toggle("active", item.dataset.id === state.conversationId);
  }

  // Every item of a conversation, oldest first, a page at a time.
  async function allItems(id) {
    const items = [];
    const query = new URLSearchParams({ limit: String(ITEMS_PAGE), order: "asc" });
    for (;;) {
      const page = await apiJson(`/v1/conversations/${id}/items?${query}`);
      items.push(...page.data);
      if (!page.has_more || !page.data.length) return items;
      query.set("after", page.last_id);
    }
  }

  // The stored message an item came from: `msg_<seq>`, `fc_<seq>_<i>` and `fco_<seq>`.
  function itemSeq(item) {
    const match = /^(?:msg|fc|fco)_(\d+)/.exec(item.id);
    return match ? match[1] : item.id;
  }

  function showItems(items) {
    $("messages").replaceChildren();
    let answer = null; // the assistant message a function_call item joins: the one of its stored message
    for (const item of items) {
      let view;
      if (item.type === "message") {
        const text = item.content.map((part) => part.text || "").join("");
        const role = item.role === "user" ? "user" : "assistant";
        view = addMessage(role, text);
        answer = role === "assistant" ? { seq: itemSeq(item), text, calls: [], view } : null;
      } else if (item.type === "function_call") {
        if (!answer || answer.seq !== itemSeq(item)) {
          answer = { seq: itemSeq(item), text: "", calls: [], view: addMessage("assistant", "") };
        }
        answer.calls.push({ id: item.call_id, name: item.name, arguments: item.arguments });
        renderAnswer(answer.view.body, answer.text, answer.calls);
        view = answer.view;
      } else if (item.type === "function_call_output") {
        view = addMessage("tool", item.output || "");
        view.meta.textContent = `Result of ${item.call_id || "a tool call"}`;
        answer = null;
        continue;
      } else {
        continue;
      }
      if (item.status === "incomplete") view.meta.textContent = "Incomplete";
    }
  }

  async function openConversation(id) {
    const [conversation, items] = await Promise.all([apiJson(`/v1/conversations/${id}`), allItems(id)]);
    state.conversationId = conversation.id;
    location.hash = `conversation=${conversation.id}`;
    $("chat-title").textContent = conversation.metadata.title || listedTitle(conversation.id) || "Untitled";
    showItems(items);
    markActive();
  }

  function newChat() {
    state.conversationId = null;
    history.replaceState(null, "", location.pathname);
    $("chat-title").textContent = "New chat";
    $("messages").replaceChildren();
    markActive();
  }

  async function createConversation(firstMessage) {
    const title = firstMessage.slice(0, TITLE_CHARS);
    const conversation = await apiJson("/v1/conversations", { method: "POST", body: { metadata: { title } } });
    // GET /v1/sessions, which the sidebar lists, shows a session's title, not its metadata.
    await api(`/v1/sessions/${conversation.id}`, { method: "PATCH", body: { title } });
    state.conversationId = conversation.id;
    location.hash = `conversation=${conversation.id}`;
    $("chat-title").textContent = title;
    await loadSessions();
  }

  // --- chat -----------------------------------------------------------------------------------

  // A tool of the Tools box: the Responses API's flat shape (`name` at the top); one in Chat
  // Completions' shape (`function: {name, ...}`) is flattened.
  function responsesTool(tool) {
    return tool && tool.function ? { type: "function", ...tool.function } : tool;
  }

  function responseBody(content) {
    const body = { model: $("model").value, input: content, stream: true };
    const maxTokens = Number.parseInt($("max-tokens").value, 10);
    if (maxTokens > 0) body.max_output_tokens = maxTokens;
    const temperature = Number.parseFloat($("temperature").value);
    if (!Number.isNaN(temperature)) body.temperature = temperature;
    if ($("response-format").value !== "text") body.text = { format: { type: $("response-format").value } };
    const tools = $("tools").value.trim();
    if (tools) {
      let parsed;
      try {
        parsed = JSON.parse(tools);
      } catch (error) {
        throw new Error(`Tools: not JSON (${error.message}).`);
      }
      body.tools = (Array.isArray(parsed) ? parsed : [parsed]).map(responsesTool);
      body.tool_choice = $("tool-choice").value;
    }
    return body;
  }

  // The error a stream's event reports, if it is one: `response.failed`, OpenAI's `error` event,
  // or an `{error}` the gateway sends when it loses the stream.
  function streamError(event) {
    if (event.type === "response.failed") return (event.response.error && event.response.error.message) || "failed";
    if (event.type === "error") return event.message || (event.error && event.error.message) || "error";
    if (!event.type && event.error) return event.error.message;
    return null;
  }

  // What the conversation keeps of a stopped response, by its status once cancelled: nothing of
  // a cancelled (or failed) one, the whole turn of one that finished before the cancel came.
  function keptAfterStop(status) {
    if (status === "cancelled" || status === "failed") return "not kept in the conversation";
    if (status === "completed" || status === "incomplete") return "it had finished: kept in the conversation";
    return "not cancelled: it may still be added to the conversation";
  }

  // The status of stored response `id` once cancelled: a stored response runs on when its stream
  // is left, so Stop cancels it. A cancel refused (the response finished meanwhile) is followed
  // by a retrieve; null when neither answers.
  async function cancelResponse(id) {
    try {
      return (await apiJson(`/v1/responses/${id}/cancel`, { method: "POST" })).status;
    } catch {
      try {
        return (await apiJson(`/v1/responses/${id}`)).status;
      } catch {
        return null;
      }
    }
  }

  // Stop: cancel the response being streamed, then abort its stream. Its id comes in the first
  // event (`response.created`): a Stop before it is carried out when it comes.
  function stop(generation) {
    generation.stopping = true;
    if (generation.responseId === null || generation.stopped !== null) return;
    generation.stopped = cancelResponse(generation.responseId).then((status) => {
      generation.status = status;
      generation.controller.abort();
    });
  }

  // Streams one response's events into `view`, re-rendering at most once a frame: the text of
  // `response.output_text.delta`, each function_call item (`response.output_item.added` brings its
  // id and name, `response.function_call_arguments.delta` pieces of its arguments), and the usage
  // and status of the closing `response.completed` or `response.incomplete`.
  async function streamAnswer(body, view, generation) {
    const answer = { startedAt: performance.now(), firstAt: null, endedAt: null, usage: null, status: null };
    const json = Boolean(body.text);
    const calls = new Map(); // output_index -> {id, name, arguments}
    let text = "";
    let pending = false;
    const render = () => {
      pending = false;
      renderAnswer(view.body, text, [...calls.values()], { json });
      view.article.scrollIntoView({ block: "end" });
    };
    const stopped = async () => {
      await generation.stopped;
      view.meta.textContent = ["Stopped", answerStats(answer), keptAfterStop(generation.status)].filter(Boolean).join(" · ");
    };
    const changed = () => {
      if (answer.firstAt === null) answer.firstAt = performance.now();
      if (!pending) {
        pending = true;
        requestAnimationFrame(render);
      }
    };
    try {
      const response = await api("/v1/responses", { method: "POST", body, signal: generation.controller.signal });
      for await (const data of sseData(response.body)) {
        const event = JSON.parse(data);
        const failure = streamError(event);
        if (failure !== null && generation.stopped !== null) break; // the cancel ended it
        if (failure !== null) throw new Error(`The answer failed: ${failure}`);
        if (event.type === "response.created") {
          generation.responseId = event.response.id;
          if (generation.stopping) stop(generation);
        } else if (event.type === "response.output_text.delta") {
          text += event.delta;
          changed();
        } else if (event.type === "response.output_item.added" && event.item.type === "function_call") {
          calls.set(event.output_index, { id: event.item.call_id, name: event.item.name, arguments: event.item.arguments });
          changed();
        } else if (event.type === "response.function_call_arguments.delta" && calls.has(event.output_index)) {
          calls.get(event.output_index).arguments += event.delta;
          changed();
        } else if (event.type === "response.completed" || event.type === "response.incomplete") {
          answer.usage = event.response.usage;
          const reason = event.response.incomplete_details && event.response.incomplete_details.reason;
          answer.status = reason ? `${event.response.status} (${reason})` : event.response.status;
        }
      }
      answer.endedAt = performance.now();
      if (generation.stopped !== null) await stopped();
      else view.meta.textContent = answerStats(answer);
    } catch (error) {
      if (error.name !== "AbortError") {
        view.meta.textContent = "Failed";
        throw error;
      }
      await stopped();
    } finally {
      render();
    }
  }

  async function send() {
    const content = $("prompt").value.trim();
    if (!content || state.generation) return;
    if (!state.key) {
      showAlert("Enter an API key first.");
      return;
    }
    if (!$("model").value) {
      showAlert("No model to send to: no worker serves one right now.");
      return;
    }
    clearAlert();
    const generation = { controller: new AbortController(), responseId: null, stopping: false, stopped: null, status: null };
    state.generation = generation;
    setGenerating(true);
    try {
      const body = responseBody(content);
      if (!state.conversationId) await createConversation(content);
      body.conversation = state.conversationId;
      $("prompt").value = "";
      addMessage("user", content);
      const view = addMessage("assistant", "");
      view.article.classList.add("streaming");
      try {
        await streamAnswer(body, view, generation);
      } finally {
        view.article.classList.remove("streaming");
      }
    } catch (error) {
      showAlert(describe(error));
      if (!$("prompt").value) $("prompt").value = content; // ready to send again
    } finally {
      state.generation = null;
      setGenerating(false);
    }
  }

  // --- key and start-up -----------------------------------------------------------------------

  async function loadModels() {
    const models = await apiJson("/v1/models");
    const select = $("model");
    const previous = select.value;
    select.replaceChildren(...models.data.map((model) => new Option(model.id, model.id)));
    if ([...select.options].some((o) => o.value === previous)) select.value = previous;
    if (!models.data.length) showAlert("No model is served right now: no worker is running. Try again shortly.", "info");
  }

  async function start() {
    if (!state.key) {
      showAlert("Enter an API key to start.", "info");
      return;
    }
    clearAlert();
    try {
      await Promise.all([loadModels(), loadSessions()]);
      const match = /^#conversation=(\w+)$/.exec(location.hash);
      if (match) await openConversation(match[1]);
    } catch (error) {
      showAlert(describe(error));
    }
  }

  function forgetKey() {
    sessionStorage.removeItem(KEY_STORAGE);
    state.key = "";
    $("api-key").value = "";
    $("model").replaceChildren();
    $("sessions").replaceChildren();
    $("more-sessions").hidden = true;
    newChat();
    showAlert("Key forgotten. Enter an API key to start.", "info");
  }

  document.addEventListener("DOMContentLoaded", () => {
    $("api-key").value = state.key;
    $("key-form").addEventListener("submit", (event) => {
      event.preventDefault();
      state.key = $("api-key").value.trim();
      sessionStorage.setItem(KEY_STORAGE, state.key);
      start();
    });
    $("key-forget").addEventListener("click", forgetKey);
    $("new-chat").addEventListener("click", newChat);
    $("more-sessions").addEventListener("click", () => loadSessions({ more: true }).catch((e) => showAlert(describe(e))));
    $("composer").addEventListener("submit", (event) => {
      event.preventDefault();
      send();
    });
    $("prompt").addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        $("composer").requestSubmit();
      }
    });
    $("stop").addEventListener("click", () => {
      if (state.generation && !state.generation.stopping) stop(state.generation);
    });
    start();
  });
})();
