// Antiphon chat page: a Realtime API client in plain JavaScript.
// One WebSocket per page; the conversation lives on the server for that connection.
"use strict";

const $ = (id) => document.getElementById(id);
const ui = {
  conversation: $("conversation"), input: $("input"), send: $("send"), stop: $("stop"),
  status: $("status"), model: $("model"), ttft: $("ttft"), tps: $("tps"), outTokens: $("out-tokens"),
  cached: $("cached"), temperature: $("temperature"), maxTokens: $("max-tokens"), apiKey: $("api-key"),
  attachments: $("attachments"), imageInput: $("image-input"),
};

// Images attached to the next message, as data URLs (sent inline: the server fetches nothing).
let attached = [];

let socket = null;
let current = null;  // the response being streamed: {id, element, text, sentAt, firstAt, lastAt, deltas}

function connect() {
  if (socket) socket.close();
  const scheme = location.protocol === "https:" ? "wss" : "ws";
  const key = ui.apiKey.value.trim();
  localStorage.setItem("antiphon-api-key", key);
  // Browsers cannot set headers on a WebSocket: the key travels as a subprotocol.
  const protocols = key ? ["realtime", `openai-insecure-api-key.${key}`] : ["realtime"];
  setStatus("connecting");
  socket = new WebSocket(`${scheme}://${location.host}/v1/realtime`, protocols);
  socket.onopen = () => setStatus("connected");
  socket.onclose = () => { setStatus("disconnected"); finishResponse(null); };
  socket.onmessage = (message) => handle(JSON.parse(message.data));
}

function setStatus(state) {
  ui.status.textContent = state;
  ui.status.className = `status ${state}`;
  ui.send.disabled = state !== "connected" || current !== null;
}

function send(event) {
  socket.send(JSON.stringify(event));
}

function addMessage(role, text, images = []) {
  const element = document.createElement("div");
  element.className = `message ${role}`;
  for (const url of images) {
    const img = document.createElement("img");
    img.src = url;
    img.alt = "attached image";
    element.appendChild(img);
  }
  if (images.length) element.appendChild(document.createElement("br"));
  element.appendChild(document.createTextNode(text));
  ui.conversation.appendChild(element);
  ui.conversation.scrollTop = ui.conversation.scrollHeight;
  return element;
}

function handle(event) {
  switch (event.type) {
    case "session.created":
      ui.model.textContent = event.session.model;
      break;
    case "response.created":
      if (current) current.id = event.response.id;
      break;
    case "response.output_text.delta":
      if (!current) break;
      const now = performance.now();
      if (current.firstAt === null) current.firstAt = now;
      current.lastAt = now;
      current.deltas += 1;
      current.text += event.delta;
      current.element.textContent = current.text;
      ui.conversation.scrollTop = ui.conversation.scrollHeight;
      break;
    case "response.done":
      finishResponse(event.response);
      break;
    case "error":
      addMessage("error", `${event.error.code}: ${event.error.message}`);
      if (current && current.id === null) finishResponse(null);
      break;
  }
}

function finishResponse(response) {
  if (!current) return;
  current.element.classList.remove("streaming");
  if (response) {
    const usage = response.usage || {};
    const outputTokens = usage.output_tokens ?? current.deltas;
    if (current.firstAt !== null) {
      ui.ttft.textContent = `${Math.round(current.firstAt - current.sentAt)} ms`;
      const seconds = (current.lastAt - current.firstAt) / 1000;
      ui.tps.textContent = seconds > 0 && outputTokens > 1 ? ((outputTokens - 1) / seconds).toFixed(1) : "–";
    }
    ui.outTokens.textContent = outputTokens;
    ui.cached.textContent = usage.input_token_details?.cached_tokens ?? 0;
    if (response.status !== "completed") {
      const note = document.createElement("span");
      note.className = "note";
      note.textContent = response.status === "incomplete" ? "(stopped at the token limit)" : `(${response.status})`;
      current.element.appendChild(note);
    }
  }
  current = null;
  ui.stop.disabled = true;
  setStatus(socket && socket.readyState === WebSocket.OPEN ? "connected" : "disconnected");
}

function attach(files) {
  for (const file of files) {
    if (!file.type.startsWith("image/")) continue;
    const reader = new FileReader();
    reader.onload = () => { attached.push(reader.result); showAttachments(); };
    reader.readAsDataURL(file);
  }
}

function showAttachments() {
  ui.attachments.replaceChildren(...attached.map((url, index) => {
    const img = document.createElement("img");
    img.src = url;
    img.alt = "attached image (click to remove)";
    img.title = "click to remove";
    img.addEventListener("click", () => { attached.splice(index, 1); showAttachments(); });
    return img;
  }));
}

$("composer").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = ui.input.value.trim();
  if ((!text && !attached.length) || current || !socket || socket.readyState !== WebSocket.OPEN) return;
  const images = attached;
  attached = [];
  showAttachments();
  ui.input.value = "";
  addMessage("user", text, images);
  send({type: "session.update", session: {
    temperature: Number(ui.temperature.value), max_output_tokens: Number(ui.maxTokens.value)}});
  const content = images.map((url) => ({type: "input_image", image_url: url}));
  if (text) content.push({type: "input_text", text});
  send({type: "conversation.item.create", item: {type: "message", role: "user", content}});
  const element = addMessage("assistant", "");
  element.classList.add("streaming");
  current = {id: null, element, text: "", sentAt: performance.now(), firstAt: null, lastAt: null, deltas: 0};
  send({type: "response.create"});
  ui.stop.disabled = false;
  setStatus("connected");
});

ui.imageInput.addEventListener("change", () => { attach(ui.imageInput.files); ui.imageInput.value = ""; });
ui.input.addEventListener("paste", (e) => {
  const files = [...(e.clipboardData?.files || [])].filter((f) => f.type.startsWith("image/"));
  if (files.length) { e.preventDefault(); attach(files); }
});
ui.input.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("composer").requestSubmit(); }
});
ui.stop.addEventListener("click", () => {
  if (current) send({type: "response.cancel", ...(current.id ? {response_id: current.id} : {})});
});
$("reconnect").addEventListener("click", connect);

ui.apiKey.value = localStorage.getItem("antiphon-api-key") || "";
connect();
