// Antiphon chat page, voice: the microphone as 24 kHz 16-bit PCM in input_audio_buffer.append
// events, and the spoken answer's audio deltas played back as they arrive.
"use strict";

const VOICE_RATE = 24000;
const APPEND_EVERY_S = 0.1;  // audio is sent in 100 ms chunks, as real-time clients do

// Runs on the audio thread: hands the page each block of microphone samples.
const CAPTURE_WORKLET = `
class Capture extends AudioWorkletProcessor {
  process(inputs) {
    if (inputs[0] && inputs[0][0]) this.port.postMessage(inputs[0][0].slice(0));
    return true;
  }
}
registerProcessor("capture", Capture);`;

function base64FromPcm16(floats) {
  const pcm = new Int16Array(floats.length);
  for (let i = 0; i < floats.length; i++) pcm[i] = Math.max(-1, Math.min(1, floats[i])) * 32767;
  let binary = "";
  const bytes = new Uint8Array(pcm.buffer);
  for (let i = 0; i < bytes.length; i += 0x8000) binary += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  return btoa(binary);
}

function floatsFromBase64Pcm16(data) {
  const binary = atob(data);
  const bytes = new Uint8Array(binary.length);
  for (let i = 0; i < binary.length; i++) bytes[i] = binary.charCodeAt(i);
  const pcm = new Int16Array(bytes.buffer, 0, bytes.length >> 1);
  const floats = new Float32Array(pcm.length);
  for (let i = 0; i < pcm.length; i++) floats[i] = pcm[i] / 32768;
  return floats;
}

class Voice {
  // `send(event)` sends a Realtime client event.
  constructor(send) {
    this.send = send;
    this.context = null;
    this.stream = null;
    this.capture = null;
    this.pending = [];
    this.pendingSamples = 0;
    this.playhead = 0;
    this.playing = new Set();
    this.bytesPlayed = 0;
  }

  async audioContext() {
    if (!this.context) this.context = new AudioContext({ sampleRate: VOICE_RATE });
    if (this.context.state === "suspended") await this.context.resume();
    return this.context;
  }

  // Starts sending the microphone; resolves once audio flows.
  async startMicrophone() {
    const context = await this.audioContext();
    if (!this.capture) {
      const url = URL.createObjectURL(new Blob([CAPTURE_WORKLET], { type: "application/javascript" }));
      await context.audioWorklet.addModule(url);
      URL.revokeObjectURL(url);
    }
    this.stream = await navigator.mediaDevices.getUserMedia({
      audio: { channelCount: 1, echoCancellation: true, noiseSuppression: true } });
    const source = context.createMediaStreamSource(this.stream);
    this.capture = new AudioWorkletNode(context, "capture");
    this.capture.port.onmessage = (message) => this.heard(message.data);
    source.connect(this.capture);
  }

  stopMicrophone() {
    this.flush();
    if (this.capture) { this.capture.disconnect(); this.capture.port.onmessage = null; this.capture = null; }
    if (this.stream) { for (const track of this.stream.getTracks()) track.stop(); this.stream = null; }
  }

  get listening() { return this.stream !== null; }

  heard(samples) {
    this.pending.push(samples);
    this.pendingSamples += samples.length;
    if (this.pendingSamples >= APPEND_EVERY_S * VOICE_RATE) this.flush();
  }

  flush() {
    if (!this.pendingSamples) return;
    const all = new Float32Array(this.pendingSamples);
    let at = 0;
    for (const part of this.pending) { all.set(part, at); at += part.length; }
    this.pending = [];
    this.pendingSamples = 0;
    this.send({ type: "input_audio_buffer.append", audio: base64FromPcm16(all) });
  }

  // Schedules one output_audio.delta right after what is already queued.
  async play(delta) {
    const context = await this.audioContext();
    const floats = floatsFromBase64Pcm16(delta);
    if (!floats.length) return;
    this.bytesPlayed += floats.length * 2;
    const buffer = context.createBuffer(1, floats.length, VOICE_RATE);
    buffer.copyToChannel(floats, 0);
    const source = context.createBufferSource();
    source.buffer = buffer;
    source.connect(context.destination);
    this.playhead = Math.max(this.playhead, context.currentTime + 0.02);
    source.start(this.playhead);
    this.playhead += buffer.duration;
    this.playing.add(source);
    source.onended = () => this.playing.delete(source);
  }

  // Barge-in or a cancelled answer: silence at once.
  stopPlayback() {
    for (const source of this.playing) { try { source.stop(); } catch (e) { /* already ended */ } }
    this.playing.clear();
    this.playhead = 0;
  }
}

window.AntiphonVoice = Voice;
