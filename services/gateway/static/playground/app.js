// Axon playground: a chat page that uses only the public API (/v1/models, /v1/sessions,
// /v1/chat/completions), so it is also a worked example of it.
"use strict";

(() => {
  const KEY_STORAGE = "axon.apiKey";
  const SESSIONS_PAGE = 50;
  const MESSAGES_PAGE = 500;
  const TITLE_CHARS = 60;

  const $ = (id) => document.getElementById(id);
  const state = {
    key: sessionStorage.getItem(KEY_STORAGE) || "",
    sessionId: null,
    lastSessionId: null, // `after` cursor of the next page of sessions, null when there is none
    generation: null, // AbortController of the answer being streamed
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

  // A stored or sent message's tool calls (OpenAI's shape) as `{id, name, arguments}`.
  function plainCalls(toolCalls) {
    return (toolCalls || []).map((c) => ({ id: c.id, name: c.function.name, arguments: c.function.arguments }));
  }

  function addMessage(role, text, calls = []) {
    const article = document.createElement("article");
    article.className = `message ${role}`;
    const body = document.createElement("div");
    body.className = "body";
    const meta = document.createElement("div");
    meta.className = "meta";
    article.append(body, meta);
    if (role === "user") body.textContent = text;
    else if (role === "tool") body.replaceChildren(jsonBlock(text));
    else renderAnswer(body, text, calls);
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
  function answerStats({ startedAt, firstAt, endedAt, usage, finishReason }) {
    const parts = [];
    if (firstAt !== null) parts.push(`TTFT ${seconds(firstAt - startedAt)}`);
    if (usage) {
      const generatingS = firstAt === null ? 0 : (endedAt - firstAt) / 1000;
      const rate = usage.completion_tokens > 1 && generatingS > 0 ? (usage.completion_tokens - 1) / generatingS : null;
      parts.push(rate === null ? "— tokens/s" : `${rate.toFixed(1)} tokens/s`);
      parts.push(`${usage.completion_tokens} tokens`);
    }
    if (finishReason) parts.push(`finish: ${finishReason}`);
    return parts.join(" · ");
  }

  // --- sessions -------------------------------------------------------------------------------

  function sessionTitle(session) {
    return session.title || "Untitled";
  }

  function sessionItem(session) {
    const item = document.createElement("li");
    item.className = "session";
    item.dataset.id = session.id;
    item.classList.toggle("active", session.id === state.sessionId);
    const open = document.createElement("button");
    open.type = "button";
    open.className = "open";
    open.textContent = sessionTitle(session);
    open.addEventListener("click", () => openSession(session.id).catch((e) => showAlert(describe(e))));
    const rename = document.createElement("button");
    rename.type = "button";
    rename.className = "rename";
    rename.textContent = "Rename";
    rename.addEventListener("click", () => startRename(item, session));
    const remove = document.createElement("button");
    remove.type = "button";
    remove.className = "delete";
    remove.textContent = "Delete";
    remove.addEventListener("click", () => deleteSession(session).catch((e) => showAlert(describe(e))));
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
      if (save && input.value.trim() && input.value.trim() !== session.title) {
        try {
          Object.assign(session, await apiJson(`/v1/sessions/${session.id}`, {
            method: "PATCH", body: { title: input.value.trim() },
          }));
        } catch (error) {
          showAlert(describe(error));
        }
      }
      open.textContent = sessionTitle(session);
      input.replaceWith(open);
      if (session.id === state.sessionId) $("chat-title").textContent = sessionTitle(session);
    };
    input.addEventListener("keydown", (event) => {
      if (event.key === "Enter") finish(true);
      if (event.key === "Escape") finish(false);
    });
    input.addEventListener("blur", () => finish(true));
  }

  async function deleteSession(session) {
    if (!confirm(`Delete "${sessionTitle(session)}" and all its messages?`)) return;
    await api(`/v1/sessions/${session.id}`, { method: "DELETE" });
    if (session.id === state.sessionId) newChat();
    await loadSessions();
  }

  function markActive() {
    for (const item of $("sessions").children) item.classList.toggle("active", item.dataset.id === state.sessionId);
  }

  async function allMessages(sessionId) {
    const messages = [];
    let after = 0;
    for (;;) {
      const page = await apiJson(`/v1/sessions/${sessionId}/messages?limit=${MESSAGES_PAGE}&after=${after}`);
      messages.push(...page.data);
      if (!page.has_more || !page.data.length) return messages;
      after = page.data[page.data.length - 1].seq;
    }
  }

  async function openSession(sessionId) {
    const [session, messages] = await Promise.all([
      apiJson(`/v1/sessions/${sessionId}`), allMessages(sessionId),
    ]);
    state.sessionId = session.id;
    location.hash = `session=${session.id}`;
    $("chat-title").textContent = sessionTitle(session);
    if (session.model && [...$("model").options].some((o) => o.value === session.model)) $("model").value = session.model;
    $("messages").replaceChildren();
    for (const message of messages) {
      const role = message.role === "user" || message.role === "tool" ? message.role : "assistant";
      const { meta } = addMessage(role, message.content || "", plainCalls(message.tool_calls));
      if (role === "tool") meta.textContent = `Result of ${message.tool_call_id || "a tool call"}`;
      else if (message.status === "cancelled") meta.textContent = "Stopped";
      else if (message.status !== "complete") meta.textContent = `Status: ${message.status}`;
    }
    markActive();
  }

  function newChat() {
    state.sessionId = null;
    history.replaceState(null, "", location.pathname);
    $("chat-title").textContent = "New chat";
    $("messages").replaceChildren();
    markActive();
  }

  async function createSession(firstMessage) {
    const session = await apiJson("/v1/sessions", {
      method: "POST", body: { title: firstMessage.slice(0, TITLE_CHARS), model: $("model").value || null },
    });
    state.sessionId = session.id;
    location.hash = `session=${session.id}`;
    $("chat-title").textContent = sessionTitle(session);
    await loadSessions();
  }

  // --- chat -----------------------------------------------------------------------------------

  function chatBody(content) {
    const body = {
      model: $("model").value,
      session_id: state.sessionId,
      messages: [{ role: "user", content }],
      stream: true,
      stream_options: { include_usage: true },
    };
    const maxTokens = Number.parseInt($("max-tokens").value, 10);
    if (maxTokens > 0) body.max_tokens = maxTokens;
    const temperature = Number.parseFloat($("temperature").value);
    if (!Number.isNaN(temperature)) body.temperature = temperature;
    if ($("response-format").value !== "text") body.response_format = { type: $("response-format").value };
    const tools = $("tools").value.trim();
    if (tools) {
      let parsed;
      try {
        parsed = JSON.parse(tools);
      } catch (error) {
        throw new Error(`Tools: not JSON (${error.message}).`);
      }
      body.tools = Array.isArray(parsed) ? parsed : [parsed];
      body.tool_choice = $("tool-choice").value;
    }
    return body;
  }

  // Folds one chunk's `delta.tool_calls` into `calls`: the first piece of call `index` brings its
  // id and name, the next ones pieces of its arguments.
  function addToolCallDeltas(calls, deltas) {
    for (const delta of deltas) {
      const call = calls[delta.index] || (calls[delta.index] = { id: null, name: "", arguments: "" });
      if (delta.id) call.id = delta.id;
      if (delta.function && delta.function.name) call.name += delta.function.name;
      if (delta.function && delta.function.arguments) call.arguments += delta.function.arguments;
    }
  }

  // Streams one answer into `view`, re-rendering at most once a frame.
  async function streamAnswer(body, view, controller) {
    const answer = { startedAt: performance.now(), firstAt: null, endedAt: null, usage: null, finishReason: null };
    const json = Boolean(body.response_format);
    const calls = [];
    let text = "";
    let pending = false;
    const render = () => {
      pending = false;
      renderAnswer(view.body, text, calls.filter(Boolean), { json });
      view.article.scrollIntoView({ block: "end" });
    };
    try {
      const response = await api("/v1/chat/completions", { method: "POST", body, signal: controller.signal });
      for await (const data of sseData(response.body)) {
        if (data === "[DONE]") break;
        const event = JSON.parse(data);
        if (event.error) throw new Error(`The answer failed: ${event.error.message}`);
        if (event.usage) answer.usage = event.usage;
        const choice = event.choices && event.choices[0];
        if (!choice) continue;
        const delta = choice.delta || {};
        if (delta.content || delta.tool_calls) {
          if (answer.firstAt === null) answer.firstAt = performance.now();
          text += delta.content || "";
          addToolCallDeltas(calls, delta.tool_calls || []);
          if (!pending) {
            pending = true;
            requestAnimationFrame(render);
          }
        }
        if (choice.finish_reason) answer.finishReason = choice.finish_reason;
      }
      answer.endedAt = performance.now();
      view.meta.textContent = answerStats(answer);
    } catch (error) {
      if (error.name !== "AbortError") {
        view.meta.textContent = "Failed";
        throw error;
      }
      view.meta.textContent = ["Stopped", answerStats(answer)].filter(Boolean).join(" · ");
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
    const controller = new AbortController();
    state.generation = controller;
    setGenerating(true);
    try {
      const body = chatBody(content);
      if (!state.sessionId) await createSession(content);
      body.session_id = state.sessionId;
      $("prompt").value = "";
      addMessage("user", content);
      const view = addMessage("assistant", "");
      view.article.classList.add("streaming");
      try {
        await streamAnswer(body, view, controller);
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
      const match = /^#session=([\w-]+)$/.exec(location.hash);
      if (match) await openSession(match[1]);
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
    $("stop").addEventListener("click", () => state.generation && state.generation.abort());
    start();
  });
})();
