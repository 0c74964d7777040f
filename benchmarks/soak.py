"""Soak: many concurrent clients mixing Realtime and HTTP for minutes, with cancels and disconnects.

    python benchmarks/soak.py                                  # 500 clients, 10 minutes, miniature model
    python benchmarks/soak.py --clients 50 --minutes 0.5       # a quick look
    python benchmarks/soak.py --mixed                          # faults under mixed load: benchmarks/mixed_soak.py

Starts the server itself on a free loopback port (the random-weight miniature of the default
model by default: its forward pass takes about a millisecond, so the serving path is what is
loaded). Each client loops: a Realtime response on its own WebSocket (a conversation that starts
afresh every few turns) or an HTTP chat completion (SSE or plain JSON) on a new connection. A
fraction of requests are cancelled (response.cancel; closing the SSE stream), most after their
first token and a quarter at once (response.cancel right behind response.create), and a fraction
disconnect abruptly mid-stream (the TCP connection drops with no close frame: a RST).

Reports requests ok / failed (with codes) / refused (429 or too_many_requests, and whether our
own requests in flight were below the server's limit then) / cancelled / disconnected / lost
(no final event within --request-timeout), p50/p99 TTFT and total latency, the RSS of the
frontend and of each worker at start and end, and whether /metrics shows KV blocks, slots and
registered request queues back at their idle values and /health ok once the load stops. Exits
non-zero if a request was lost or failed, one was refused below the limit, the server did not
come back to idle, or a process grew by more than --max-rss-growth-mib.

One file on purpose (~530 lines): a soak is read top to bottom as its workload, its verdicts and
its report; the HTTP/SSE client it shares with the other benchmarks is benchmarks/http_client.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import websockets

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.http_client import abort, read_head, send_request, sse_events  # noqa: E402

WORDS = ("river stone lantern garden harbor violin orbit maple copper signal winter meadow engine "
         "pilot canyon marble thunder ribbon falcon tide summit glacier ember willow").split()
# Server-side cleanup of a request the client walked away from is not instant: for this long it
# may still hold its slot, so a refusal then is not counted as "below the limit".
ABANDON_GRACE_S = 2.0
BASELINE_TIMEOUT_S = 15.0


@dataclass
class Result:
    protocol: str            # realtime | http-sse | http-json
    plan: str                # complete | cancel | cancel-at-once | disconnect
    outcome: str = "lost"    # ok | failed | refused | cancelled | disconnected | lost
    code: str | None = None  # the error code of a failed or refused request
    below_limit: bool = False  # refused while our own requests in flight were under the limit
    ttft: float | None = None
    total: float | None = None


@dataclass
class Load:
    """What the clients share: the plan, and the count of our requests the server may hold."""

    args: argparse.Namespace
    url: str
    ws_url: str
    port: int
    limit: int
    stop_at: float
    results: list[Result] = field(default_factory=list)
    in_flight: int = 0
    abandoned: deque = field(default_factory=deque)  # when a request was walked away from

    def outstanding(self) -> int:
        now = time.monotonic()
        while self.abandoned and now - self.abandoned[0] > ABANDON_GRACE_S:
            self.abandoned.popleft()
        return self.in_flight + len(self.abandoned)


class Refused(Exception):
    def __init__(self, code: str) -> None:
        self.code = code


class Failed(Exception):
    def __init__(self, code: str) -> None:
        self.code = code


# ---- the server ------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def limit_flags(queue_limit: int, max_num_seqs: int) -> list[str]:
    """The admission limit's flags: the server has had two spellings of it."""
    help_text = subprocess.run([sys.executable, "-m", "frontend.cli", "serve", "--help"], cwd=REPO,
                               capture_output=True, text=True).stdout
    if "--max-waiting-requests" in help_text:
        return ["--max-waiting-requests", str(max(0, queue_limit - max_num_seqs))]
    return ["--max-concurrent-requests", str(queue_limit)]


def start_server(args, port: int, log) -> subprocess.Popen:
    command = [sys.executable, "-m", "frontend.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
               "--max-num-seqs", str(args.max_num_seqs), *limit_flags(args.queue_limit, args.max_num_seqs),
               # Every client comes from 127.0.0.1: the per-client cap must not refuse them.
               "--max-connections-per-client", str(4 * args.clients + 64),
               *args.server_arg]
    if args.model_path:
        command += ["--model", args.model_path]
    return launch(command, port, log)


def launch(command: list[str], port: int, log) -> subprocess.Popen:
    """Runs `command` (an `antiphon serve`), its output into `log`, until /health is 200."""
    process = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}; see {log.name}")
        if http_get(port, "/health")[0] == 200:
            return process
        time.sleep(0.25)
    process.kill()
    raise RuntimeError(f"the server did not start; see {log.name}")


def http_get(port: int, path: str, headers: dict | None = None) -> tuple[int, str]:
    import urllib.error
    import urllib.request
    try:
        request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers or {})
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError:
        return 0, ""


def metrics(port: int, key: str | None = None) -> dict[str, float]:
    """/metrics as name -> value; `key`: the API key it wants when the server has keys."""
    values = {}
    for line in http_get(port, "/metrics", {"Authorization": f"Bearer {key}"} if key else None)[1].splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def held_gauges(values: dict[str, float]) -> dict[str, float]:
    """KV blocks, slots and registered request queues: what must return to idle."""
    names = ["antiphon_kv_blocks_used", "antiphon_request_slots_held", "antiphon_engine_requests_registered"]
    if "antiphon_request_slots_held" not in values:  # before the slot gauges existed
        names.append("antiphon_requests_in_flight")
    return {name: values[name] for name in names if name in values}


def process_rss(server: psutil.Process) -> dict[str, int]:
    """RSS in bytes of the frontend and each worker, named by role."""
    rss = {"frontend": server.memory_info().rss}
    for child in server.children(recursive=True):
        try:
            command = child.cmdline()
            # `-m workers.decoder_process` -> decoder; `-m frontend.grammar_workers` -> grammar_workers
            module = command[command.index("-m") + 1] if "-m" in command[:-1] else None
            role = module.rpartition(".")[2].removesuffix("_process") if module else f"pid {child.pid}"
            rss[f"{role} ({child.pid})"] = child.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return rss


# ---- one request -----------------------------------------------------------------------------

def prompt(rng: random.Random) -> str:
    return "Tell me about " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 30))) + "."


async def http_request(load: Load, rng: random.Random, result: Result, streaming: bool) -> None:
    args = load.args
    body = json.dumps({"messages": [{"role": "user", "content": prompt(rng)}], "stream": streaming,
                       "max_tokens": rng.randint(max(1, args.max_tokens // 2), args.max_tokens),
                       "temperature": 0.8, "seed": rng.randrange(2**31)}).encode()
    started = time.monotonic()
    reader, writer = await send_request("127.0.0.1", load.port, "POST", "/v1/chat/completions", body)
    try:
        if result.plan == "disconnect" and not streaming:
            abort(writer)
            result.outcome = "disconnected"
            return
        if result.plan == "cancel-at-once":
            result.outcome = "cancelled"
            return  # the connection closes before the answer
        status, headers = await read_head(reader)
        if status != 200:
            data = await reader.read()
            code = error_code(data)
            raise Refused(code) if status == 429 else Failed(f"http {status} {code}")
        if not streaming:
            completion = json.loads(await reader.read())
            result.ttft = result.total = time.monotonic() - started
            reason = completion["choices"][0]["finish_reason"]
            if reason not in ("stop", "length"):
                raise Failed(f"finish_reason {reason}")
            result.outcome = "ok"
            return
        async for event in sse_events(reader, headers):
            if event == "[DONE]":
                result.total = time.monotonic() - started
                result.outcome = "ok"
                return
            chunk = json.loads(event)
            if "error" in chunk:
                raise Failed(chunk["error"].get("code") or "sse error")
            if result.ttft is None and any(c["delta"].get("content") for c in chunk.get("choices", [])):
                result.ttft = time.monotonic() - started
                if result.plan == "cancel":
                    result.outcome = "cancelled"
                    return  # closing the stream is an HTTP client's cancel
                if result.plan == "disconnect":
                    abort(writer)
                    result.outcome = "disconnected"
                    return
        raise Failed("stream ended without [DONE]")
    finally:
        writer.close()


def error_code(data: bytes) -> str:
    try:
        return json.loads(data)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return "unparsed"


class RealtimeConnection:
    """One client's WebSocket; its conversation starts afresh every --turns responses."""

    def __init__(self, load: Load) -> None:
        self.load = load
        self.ws = None
        self.turns = 0
        self.ids = 0

    async def open(self) -> None:
        self.ws = await websockets.connect(self.load.ws_url, max_size=None, compression=None, ping_interval=None,
                                           open_timeout=self.load.args.request_timeout)
        assert json.loads(await self.ws.recv())["type"] == "session.created"
        self.turns = 0

    async def close(self) -> None:
        if self.ws is not None:
            await self.ws.close()
            self.ws = None

    async def request(self, rng: random.Random, result: Result) -> None:
        args = self.load.args
        if self.ws is None or self.turns >= args.turns:
            await self.close()
            await self.open()
        self.turns += 1
        self.ids += 1
        create_id, cancel_id = f"create-{self.ids}", f"cancel-{self.ids}"
        await self.ws.send(json.dumps({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": prompt(rng)}]}}))
        started = time.monotonic()
        await self.ws.send(json.dumps({"type": "response.create", "event_id": create_id, "response": {
            "max_output_tokens": rng.randint(max(1, args.max_tokens // 2), args.max_tokens)}}))
        if result.plan == "cancel-at-once":  # the conversation's response, before we know its id
            await self.ws.send(json.dumps({"type": "response.cancel", "event_id": cancel_id}))
        response_id = None
        while True:
            event = json.loads(await self.ws.recv())
            kind = event["type"]
            if kind == "error":
                code = event["error"].get("code")
                if str(event["error"].get("event_id")).startswith("cancel-") and code == "response_cancel_not_active":
                    continue  # the response ended before our cancel reached it (maybe a previous turn's)
                if event["error"].get("event_id") == create_id or response_id is None:
                    raise Refused(code) if code == "too_many_requests" else Failed(code)
                raise Failed(code)
            if kind == "response.created":
                response_id = event["response"]["id"]
            elif kind == "response.output_text.delta" and result.ttft is None:
                result.ttft = time.monotonic() - started
                if result.plan == "cancel":
                    await self.ws.send(json.dumps({"type": "response.cancel", "event_id": cancel_id,
                                                   "response_id": response_id}))
                elif result.plan == "disconnect":
                    self.ws.transport.abort()
                    self.ws = None
                    result.outcome = "disconnected"
                    return
            elif kind == "response.done" and response_id is None:
                raise Failed("response.done without response.created")  # a client never learns its id
            elif kind == "response.done" and event["response"]["id"] == response_id:
                status = event["response"]["status"]
                result.total = time.monotonic() - started
                finished = status in ("completed", "incomplete")
                if status == "cancelled" or (finished and result.plan.startswith("cancel")):
                    result.outcome = "cancelled"  # a cancel can lose the race with the last token
                elif finished:
                    result.outcome = "ok"
                else:
                    details = event["response"].get("status_details") or {}
                    raise Failed((details.get("error") or {}).get("code") or status)
                return


async def client(load: Load, index: int) -> None:
    args = load.args
    rng = random.Random(args.seed * 1_000_003 + index)
    realtime = RealtimeConnection(load)
    await asyncio.sleep(rng.uniform(0, min(5.0, args.minutes * 6)))  # stagger the first connections
    try:
        while time.monotonic() < load.stop_at:
            draw = rng.random()
            plan = "cancel" if draw < args.cancel_fraction else \
                "disconnect" if draw < args.cancel_fraction + args.disconnect_fraction else "complete"
            if plan == "cancel" and rng.random() < 0.25:
                plan = "cancel-at-once"
            if rng.random() < args.http_fraction:
                streaming = plan.startswith("cancel") or rng.random() < 0.7
                result = Result("http-sse" if streaming else "http-json", plan)
                work = http_request(load, rng, result, streaming)
            else:
                result = Result("realtime", plan)
                work = realtime.request(rng, result)
            load.results.append(result)
            load.in_flight += 1
            try:
                async with asyncio.timeout(args.request_timeout):
                    await work
            except Refused as exc:
                result.outcome, result.code = "refused", exc.code
                result.below_limit = load.outstanding() <= load.limit
            except Failed as exc:
                result.outcome, result.code = "failed", exc.code
            except TimeoutError:
                result.outcome = "lost"
            except (OSError, websockets.ConnectionClosed, asyncio.IncompleteReadError, ValueError) as exc:
                result.outcome, result.code = "failed", f"{type(exc).__name__}: {exc}"[:80]
            finally:
                load.in_flight -= 1
                if result.outcome in ("cancelled", "disconnected", "lost"):
                    load.abandoned.append(time.monotonic())
            if result.outcome != "ok" and result.protocol == "realtime" and realtime.ws is not None:
                await realtime.close()  # a connection in an unknown state is not reused
            await asyncio.sleep(rng.uniform(0, args.think_s))
    finally:
        await realtime.close()


# ---- the run ---------------------------------------------------------------------------------

async def run_load(load: Load) -> None:
    tasks = [asyncio.create_task(client(load, i)) for i in range(load.args.clients)]
    await asyncio.gather(*tasks)


def wait_for_idle(port: int, idle: dict[str, float], key: str | None = None) -> tuple[bool, dict[str, float]]:
    deadline = time.monotonic() + BASELINE_TIMEOUT_S
    while True:
        now = held_gauges(metrics(port, key))
        back = bool(now) and all(name in now and now[name] <= idle[name] for name in idle)
        if back or time.monotonic() > deadline:
            return back, now
        time.sleep(0.2)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def report(load: Load, elapsed: float, rss: dict[str, dict[str, int]], idle: dict, after: dict,
           back: bool, health: int, max_growth_mib: float) -> bool:
    results = load.results
    outcomes = Counter(r.outcome for r in results)
    failed_codes = Counter(r.code for r in results if r.outcome == "failed")
    refused = [r for r in results if r.outcome == "refused"]
    below = sum(r.below_limit for r in refused)
    ok = [r for r in results if r.outcome == "ok"]
    print(f"\nsoak: {load.args.clients} clients, {elapsed / 60:.1f} min, {len(results)} requests "
          f"({Counter(r.protocol for r in results)}), server limit {load.limit} admitted requests")
    rows = [("ok", outcomes["ok"]), ("failed", outcomes["failed"]),
            ("refused (below the limit)", f"{len(refused)} ({below})"),
            ("cancelled", outcomes["cancelled"]), ("disconnected", outcomes["disconnected"]),
            ("lost or hung", outcomes["lost"])]
    for name, value in rows:
        print(f"  {name:<28} {value}")
    for (protocol, plan), n in Counter((r.protocol, r.plan) for r in results if r.outcome == "lost").most_common():
        print(f"    lost {n} x {protocol} {plan}")
    for code, n in failed_codes.most_common(10):
        print(f"    failed {n} x {code}")
    for code, n in Counter(r.code for r in refused).most_common(5):
        print(f"    refused {n} x {code}")
    for protocol in ("realtime", "http-sse", "http-json", "all"):
        chosen = [r for r in ok if protocol in ("all", r.protocol)]
        ttft = [r.ttft for r in chosen if r.ttft is not None]
        total = [r.total for r in chosen if r.total is not None]
        print(f"  {protocol:<10} ok {len(chosen):>6}  TTFT p50/p99 {ms(percentile(ttft, 0.5))}/"
              f"{ms(percentile(ttft, 0.99))} ms  total p50/p99 {ms(percentile(total, 0.5))}/"
              f"{ms(percentile(total, 0.99))} ms")
    grew = []
    print(f"  {'RSS MiB':<18}     idle    start      end   growth")
    for name in rss["end"]:
        values = [rss[phase].get(name) for phase in ("idle", "start", "end")]
        base = values[1] if values[1] is not None else values[0]
        growth = None if base is None else (values[2] - base) / 2**20
        if growth is not None and growth > max_growth_mib:
            grew.append(name)
        cells = " ".join("       -" if v is None else f"{v / 2**20:8.1f}" for v in values)
        print(f"  {name:<18} {cells}  {'-' if growth is None else f'{growth:+.1f}'}")
    print(f"  /metrics idle {idle}\n  /metrics after {after}: {'back to idle' if back else 'NOT back to idle'}")
    print(f"  /health {health}")
    problems = []
    if outcomes["lost"]:
        problems.append(f"{outcomes['lost']} lost or hung")
    if outcomes["failed"]:
        problems.append(f"{outcomes['failed']} failed")
    if below:
        problems.append(f"{below} refused below the limit")
    if not back:
        problems.append("not back to idle")
    if health != 200:
        problems.append(f"/health {health}")
    if grew:
        problems.append(f"RSS grew over {max_growth_mib:g} MiB: {', '.join(grew)}")
    verdict = "PASS" if not problems else "FAIL: " + "; ".join(problems)
    print(f"\nverdict: {verdict}")
    return not problems


def main() -> int:
    if "--mixed" in sys.argv[1:]:
        # Faults under mixed load has its own options: python benchmarks/soak.py --mixed --help.
        from benchmarks.mixed_soak import main as mixed_main
        return mixed_main([arg for arg in sys.argv[1:] if arg != "--mixed"])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=500)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--cancel-fraction", type=float, default=0.2)
    parser.add_argument("--disconnect-fraction", type=float, default=0.1)
    parser.add_argument("--http-fraction", type=float, default=0.5, help="the rest are Realtime responses")
    parser.add_argument("--max-tokens", type=int, default=16, help="output budgets are uniform in [n/2, n]")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--turns", type=int, default=6, help="Realtime responses per connection before a new one")
    parser.add_argument("--think-s", type=float, default=0.2, help="each client waits up to this long between requests")
    parser.add_argument("--request-timeout", type=float, default=180.0,
                        help="a request with no final event by then is lost")
    parser.add_argument("--model-path", default=None, help="default: the miniature of the default model")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--queue-limit", type=int, default=None,
                        help="requests the server admits at once (default: 2x clients, so none is refused)")
    parser.add_argument("--server-arg", action="append", default=[], help="passed to `antiphon serve` (repeatable)")
    parser.add_argument("--max-rss-growth-mib", type=float, default=64.0,
                        help="a process growing more than this from start to end fails the run")
    args = parser.parse_args()
    if args.model_path is None:
        from benchmarks.miniature import ensure_miniature
        args.model_path = str(ensure_miniature())
    args.queue_limit = args.queue_limit or 2 * args.clients

    port = free_port()
    log = tempfile.NamedTemporaryFile("w", prefix="antiphon-soak-", suffix=".log", delete=False)
    print(f"server log: {log.name}")
    process = start_server(args, port, log)
    try:
        server = psutil.Process(process.pid)
        values = metrics(port)
        limit = int(values.get("antiphon_request_slots_total", args.queue_limit))
        idle = held_gauges(values)
        rss = {"idle": process_rss(server)}
        load = Load(args, f"http://127.0.0.1:{port}", f"ws://127.0.0.1:{port}/v1/realtime", port, limit,
                    stop_at=time.monotonic() + args.minutes * 60)
        started = time.monotonic()

        async def run() -> None:
            # "start" memory is taken once every client is connected and working: the first
            # minutes fill allocator pools, which is not a leak.
            warm = asyncio.create_task(run_load(load))
            await asyncio.sleep(min(60.0, args.minutes * 60 * 0.2))
            rss["start"] = process_rss(server)
            await warm

        try:
            import uvloop  # the server's own event loop; 500 clients in one process need it too
            uvloop.run(run())
        except ImportError:
            asyncio.run(run())
        elapsed = time.monotonic() - started
        back, after = wait_for_idle(port, idle)
        health = http_get(port, "/health")[0]
        rss["end"] = process_rss(server)
        passed = report(load, elapsed, rss, idle, after, back, health, args.max_rss_growth_mib)
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
