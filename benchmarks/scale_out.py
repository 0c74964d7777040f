"""Data-parallel serving on this machine: two replicas, a multi-tenant workload with images,
routed cache-aware vs least-loaded vs round-robin; then the same router past one machine
(benchmarks/router_simulation.py at 8, 64 and 256 replicas). One table each, one run.

    python benchmarks/scale_out.py             # both tables (about 10 minutes on 2 cores)
    python benchmarks/scale_out.py --quick     # small model and workload, to check the script
    python benchmarks/scale_out.py --skip-live # the simulation alone

The model is benchmarks/multimodal.py's random-weight Qwen2-VL (the real architecture, built
once into the cache folder). The workload: TENANTS system prompts, each tenant's users opening
their conversation with the tenant's image (a product photo, a document) and a question, then
more turns; each user's turns in order, SESSIONS users at once. Each policy gets a fresh server
(`antiphon serve --data-parallel-size 2 --routing-policy P`, local processes): its two decoders
take one torch thread each (the replica set's split of the cores), the encoders, the front end
and this client share the same two cores, unpinned.

Printed per policy: prefix hit rate (prompt tokens the replicas' prefix caches served, from
/metrics), images the encoders ran (vs images sent), TTFT p50 / p99 at the client, requests a
second; ratios against cache-aware.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks import router_simulation  # noqa: E402
from benchmarks.http_client import stream_chat  # noqa: E402
from benchmarks.multimodal import FULL, QUICK, ensure_model, image_turn, jpeg_data_url, photo, words  # noqa: E402
from frontend.replica_router import POLICIES  # noqa: E402


@dataclass(frozen=True)
class Workload:
    tenants: int = 16
    users: int = 4
    turns: int = 3
    sessions: int = 8
    system_words: int = 160
    question_words: int = 12
    max_tokens: int = 8


QUICK_WORKLOAD = Workload(tenants=4, users=2, turns=2, sessions=4, system_words=40)


def conversations(workload: Workload, image_size: tuple[int, int], seed: int = 0) -> list[list[list[dict]]]:
    """Per user, the message lists of its turns (each turn's answer is filled in as it comes)."""
    rng = random.Random(seed)
    users = []
    for tenant in range(workload.tenants):
        system = {"role": "system", "content": f"Tenant {tenant}. " + words(rng, workload.system_words)}
        image = jpeg_data_url(photo(1000 + tenant, image_size))
        for _ in range(workload.users):
            first = image_turn("", image, words(rng, workload.question_words))
            later = [{"role": "user", "content": words(rng, workload.question_words)}
                     for _ in range(workload.turns - 1)]
            users.append([system, first, *later])
    rng.shuffle(users)
    return users


async def run_workload(url: str, users: list[list[dict]], workload: Workload) -> tuple[list[float], float, int]:
    """(TTFTs, seconds, errors): SESSIONS users at a time, each user's turns in order."""
    queue = list(users)
    ttfts, errors = [], 0

    async def session_runner() -> None:
        nonlocal errors
        while queue:
            system, first, *later = queue.pop()
            history = [system]
            for turn in [first, *later]:
                history.append(turn)
                result = await stream_chat(url, {"messages": history, "max_tokens": workload.max_tokens,
                                                 "ignore_eos": True, "temperature": 0, "stream": True,
                                                 "return_token_ids": True}, None)
                if result.error or not result.token_times:
                    errors += 1
                    break
                ttfts.append(result.ttft)
                history.append({"role": "assistant", "content": result.text})

    started = time.perf_counter()
    await asyncio.gather(*(session_runner() for _ in range(workload.sessions)))
    return ttfts, time.perf_counter() - started, errors


def metric_sum(url: str, name: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return sum(float(value) for value in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE))


def start_server(model: Path, port: int, policy: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "frontend.cli", "serve", "--model", str(model), "--port", str(port),
               "--data-parallel-size", "2", "--routing-policy", policy, "--no-voice", "--quantization", "none"]
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as response:
                if response.status == 200:
                    return process
        except OSError:
            time.sleep(0.5)
    process.kill()
    raise RuntimeError("the server did not start")


def measure_policy(model: Path, policy: str, users, workload: Workload, port: int) -> dict:
    process = start_server(model, port, policy)
    url = f"http://127.0.0.1:{port}"
    try:
        ttfts, seconds, errors = asyncio.run(run_workload(url, users, workload))
        hits = metric_sum(url, "antiphon_replica_prefix_cache_hits_total")
        queries = metric_sum(url, "antiphon_replica_prefix_cache_queries_total")
        encoded = metric_sum(url, "antiphon_encoder_items_encoded_total")
    finally:
        process.terminate()
        process.wait(timeout=60)
    ttfts.sort()
    return {"policy": policy, "requests": len(ttfts), "errors": errors, "hit_rate": hits / max(1.0, queries),
            "encoded": int(encoded), "ttft_p50": ttfts[len(ttfts) // 2], "ttft_p99": ttfts[int(len(ttfts) * 0.99)],
            "rate": len(ttfts) / seconds}


def print_live(rows: list[dict], workload: Workload, images_sent: int) -> None:
    print(f"\n2 replicas on this machine; {workload.tenants} tenants x {workload.users} users x {workload.turns} turns, "
          f"{workload.sessions} users at once, {workload.max_tokens} output tokens; {images_sent} image turns sent")
    print(f"{'policy':<13} {'requests':>8} {'prefix hit':>10} {'images encoded':>14} {'TTFT p50':>9} "
          f"{'TTFT p99':>9} {'req/s':>7} {'vs cache-aware':>15}")
    base = next(row for row in rows if row["policy"] == "cache-aware")
    for row in rows:
        print(f"{row['policy']:<13} {row['requests']:>8} {row['hit_rate']:>10.1%} {row['encoded']:>14} "
              f"{row['ttft_p50'] * 1000:>7.0f}ms {row['ttft_p99'] * 1000:>7.0f}ms {row['rate']:>7.2f} "
              f"{row['rate'] / base['rate']:>14.2f}x" + (f"  ({row['errors']} errors)" if row["errors"] else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--skip-live", action="store_true")
    parser.add_argument("--port", type=int, default=8790)
    args = parser.parse_args()
    scale = QUICK if args.quick else FULL
    workload = QUICK_WORKLOAD if args.quick else Workload()
    if not args.skip_live:
        model = ensure_model(scale)
        users = conversations(workload, scale.image_size)
        rows = [measure_policy(model, policy, users, workload, args.port) for policy in POLICIES]
        print_live(rows, workload, images_sent=len(users))
    shape = router_simulation.QUICK if args.quick else router_simulation.Shape()
    print()
    router_simulation.print_table(router_simulation.run((8, 64, 256), shape), shape)


if __name__ == "__main__":
    main()
