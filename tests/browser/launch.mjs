// Debian's Chromium, headless, for the page tests; `extraArgs` adds flags (a fake microphone...).
import { chromium } from "playwright-core";

export async function launchChromium(extraArgs = []) {
  return chromium.launch({
    executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
    // This machine has no network beyond loopback: keep Chromium from reaching out.
    args: ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", ...extraArgs],
  });
}

// Opens `url`, collects console errors, waits until the page is connected.
export async function openChatPage(browser, url) {
  const page = await browser.newPage();
  const consoleErrors = [];
  page.on("console", (m) => { if (m.type() === "error") consoleErrors.push(m.text()); });
  await page.goto(url);
  await page.waitForSelector(".status.connected");
  return { page, consoleErrors };
}
