// Opens the chat page in headless Chromium, sends a message, waits for the streamed answer.
// Usage: node chat_page.mjs URL MESSAGE SCREENSHOT_PATH [IMAGE_PATH]
// Prints one JSON line: the answer's text, what the page showed while streaming, the panel,
// and how many images the user's message shows (IMAGE_PATH is attached with the Image button).
import { launchChromium, openChatPage } from "./launch.mjs";

const [url, message, screenshot, image] = process.argv.slice(2);
const browser = await launchChromium();
try {
  const { page, consoleErrors } = await openChatPage(browser, url);
  await page.fill("#temperature", "0");
  await page.fill("#max-tokens", "40");
  // Record every text the assistant bubble shows, from inside the page: polling from here
  // would miss a fast stream.
  await page.evaluate(() => {
    window.__partials = [];
    new MutationObserver(() => {
      const bubble = document.querySelector(".message.assistant");
      if (bubble) window.__partials.push(bubble.textContent);
    }).observe(document.getElementById("conversation"), { childList: true, subtree: true, characterData: true });
  });
  if (image) {
    await page.setInputFiles("#image-input", image);
    await page.waitForSelector("#attachments img");
  }
  await page.fill("#input", message);
  await page.click("#send");
  await page.waitForSelector(".message.assistant:not(.streaming)", { timeout: 60000 });
  const partials = await page.evaluate(() => window.__partials);
  const answer = await page.$eval(".message.assistant", (e) => e.firstChild ? e.firstChild.textContent : "");
  const panel = {
    ttft: await page.textContent("#ttft"), tps: await page.textContent("#tps"),
    outTokens: await page.textContent("#out-tokens"), cached: await page.textContent("#cached"),
  };
  const stopDisabled = await page.$eval("#stop", (e) => e.disabled);
  const userImages = await page.$$eval(".message.user img", (images) =>
    images.filter((i) => i.complete && i.naturalWidth > 0).length);
  const errors = await page.$$eval(".message.error", (items) => items.map((e) => e.textContent));
  await page.screenshot({ path: screenshot });
  console.log(JSON.stringify({ answer, partials: [...new Set(partials)], panel, stopDisabled, consoleErrors,
                               userImages, errors }));
} finally {
  await browser.close();
}
