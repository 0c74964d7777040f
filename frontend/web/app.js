// Antiphon chat page: a Realtime API client in plain JavaScript.
// One WebSocket per page; the conversation lives on the server for that connection.
"use strict";

const $ = (id) => document.getElementById(id);
const ui = {
  conversation: $("conversation"), input: $("input"), send: $("send"), stop: $("stop"),
  status: $("status"), model: $("model"), ttft: $("ttft"), tps: $("tps"), outTokens: $("out-tokens"),
  cached: $("cached"), temperature: $("temperature"), maxTokens: $("max-tokens"), apiKey: $("api-key"),
  attachments: $("attachments"), imageInput: $("image-input"), mic: $("mic"), talk: $("talk"),
  speakAnswers: $("speak-answers"),
};

// Images attached to the next message, as data URLs (sent inline: the server fetches nothing).
let attached = [];

let socket = null;
let current = null;  // the response being streamed: {id, element, text, sentAt, firstAt, lastAt, deltas}
const voice = new window.AntiphonVoice((event) => send(event));
// How much answer audio the page has played, for the browser test.
Object.defineProperty(document, "voiceBytesPlayed", { get: () => voice.bytesPlayed });
let spokenTurn = null;  // the bubble of what the user is saying, until its transcript arrives
let pushToTalk = false;

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
  socket.onclose = () => { setStatus("disconnected"); finishResponse(null); stopVoice(); };
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
      // Server VAD starts answers on its own: they get a bubble too.
      if (!current) startAnswer(performance.now());
      current.id = event.response.id;
      break;
    case "response.output_text.delta":
    case "response.output_audio_transcript.delta":
      if (current) showDelta(event.delta);
      break;
    case "response.output_audio.delta":
      voice.play(event.delta);
      break;
    case "input_audio_buffer.speech_started":
      voice.stopPlayback();  // barge-in: the server cancels the answer, the page stops playing it
      if (!spokenTurn) spokenTurn = addMessage("user", "(listening…)");
      spokenTurn.classList.add("pending");
      break;
    case "input_audio_buffer.committed":
      if (!spokenTurn) spokenTurn = addMessage("user", "(transcribing…)");
      spokenTurn.textContent = "(transcribing…)";
      break;
    case "conversation.item.input_audio_transcription.completed":
      if (spokenTurn) { spokenTurn.textContent = event.transcript; spokenTurn.classList.remove("pending"); }
      spokenTurn = null;
      break;
    case "conversation.item.input_audio_transcription.failed":
      if (spokenTurn) spokenTurn.remove();
      spokenTurn = null;
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

function startAnswer(sentAt) {
  const element = addMessage("assistant", "");
  element.classList.add("streaming");
  current = {id: null, element, text: "", sentAt, firstAt: null, lastAt: null, deltas: 0};
  ui.stop.disabled = false;
}

function showDelta(delta) {
  const now = performance.now();
  if (current.firstAt === null) current.firstAt = now;
  current.lastAt = now;
  current.deltas += 1;
  current.text += delta;
  current.element.textContent = current.text;
  ui.conversation.scrollTop = ui.conversation.scrollHeight;
}

// The session's settings from the panel; `turnDetection` undefined leaves it as it is.
function sessionSettings(turnDetection) {
  const session = {temperature: Number(ui.temperature.value), max_output_tokens: Number(ui.maxTokens.value),
                   output_modalities: [ui.speakAnswers.checked ? "audio" : "text"]};
  if (turnDetection !== undefined) session.audio = {input: {turn_detection: turnDetection}};
  return {type: "session.update", session};
}

async function toggleMicrophone() {
  if (voice.listening) { stopVoice(); return; }
  if (!socket || socket.readyState !== WebSocket.OPEN) return;
  send(sessionSettings({type: "server_vad", create_response: true, interrupt_response: true}));
  try {
    await voice.startMicrophone();
  } catch (error) {
    addMessage("error", `microphone: ${error.message}`);
    return;
  }
  ui.mic.classList.add("on");
  ui.mic.textContent = "Mic on";
  ui.talk.disabled = true;
}

function stopVoice() {
  voice.stopMicrophone();
  ui.mic.classList.remove("on");
  ui.mic.textContent = "Mic";
  ui.talk.classList.remove("on");
  ui.talk.disabled = false;
  pushToTalk = false;
}

async function startTalking() {
  if (voice.listening || current || !socket || socket.readyState !== WebSocket.OPEN) return;
  pushToTalk = true;
  send(sessionSettings(null));  // no VAD: releasing the button commits the turn
  send({type: "input_audio_buffer.clear"});
  try {
    await voice.startMicrophone();
  } catch (error) {
    pushToTalk = false;
    addMessage("error", `microphone: ${error.message}`);
    return;
  }
  ui.talk.classList.add("on");
  ui.mic.disabled = true;
}

function stopTalking() {
  if (!pushToTalk) return;
  stopVoice();
  ui.mic.disabled = false;
  send({type: "input_audio_buffer.commit"});
  startAnswer(performance.now());
  send({type: "response.create"});
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
  send(sessionSettings(undefined));
  const content = images.map((url) => ({type: "input_image", image_url: url}));
  if (text) content.push({type: "input_text", text});
  send({type: "conversation.item.create", item: {type: "message", role: "user", content}});
  startAnswer(performance.now());
  send({type: "response.create"});
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
  voice.stopPlayback();
  if (current) send({type: "response.cancel", ...(current.id ? {response_id: current.id} : {})});
});
ui.mic.addEventListener("click", toggleMicrophone);
ui.talk.addEventListener("pointerdown", startTalking);
ui.talk.addEventListener("pointerup", stopTalking);
ui.talk.addEventListener("pointerleave", stopTalking);
$("reconnect").addEventListener("click", connect);

ui.apiKey.value = localStorage.getItem("antiphon-api-key") || "";
connect();
