// Opens the chat page in headless Chromium with a fake microphone that says QUESTION_WAV,
// turns on "Speak the answers" and the hands-free Mic, and waits for the transcript of the
// question and the spoken answer.
// Usage: node voice_page.mjs URL QUESTION_WAV SCREENSHOT_PATH
// Prints one JSON line: the user's transcript, the answer's text, the answer's audio bytes
// the page scheduled for playback, errors shown and console errors.
import { launchChromium, openChatPage } from "./launch.mjs";

const [url, questionWav, screenshot] = process.argv.slice(2);
const browser = await launchChromium([
  "--autoplay-policy=no-user-gesture-required", "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
  `--use-file-for-fake-audio-capture=${questionWav}%noloop`]);
try {
  const { page, consoleErrors } = await openChatPage(browser, url);
  await page.fill("#temperature", "0");
  await page.fill("#max-tokens", "30");
  await page.check("#speak-answers");
  await page.click("#mic");
  await page.waitForSelector("#mic.on", { timeout: 10000 });
  await page.waitForSelector(".message.user:not(.pending)", { timeout: 60000 });
  await page.waitForSelector(".message.assistant:not(.streaming)", { timeout: 90000 });
  // Let the last audio deltas land.
  await page.waitForTimeout(500);
  const transcript = await page.$eval(".message.user", (e) => e.textContent);
  const answer = await page.$eval(".message.assistant", (e) => e.firstChild ? e.firstChild.textContent : "");
  const audioBytes = await page.evaluate(() => document.voiceBytesPlayed ?? -1);
  const errors = await page.$$eval(".message.error", (items) => items.map((e) => e.textContent));
  await page.screenshot({ path: screenshot });
  console.log(JSON.stringify({ transcript, answer, audioBytes, errors, consoleErrors }));
} finally {
  await browser.close();
}
