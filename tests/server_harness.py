"""Starts the real server (`python -m frontend.cli serve`) on a free loopback port."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    def __init__(self, model: Path | None, *args: str, log_dir: Path, timeout: float = 300.0,
                 voice: bool = False) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.ws_url = f"ws://127.0.0.1:{self.port}/v1/realtime"
        self.log_path = log_dir / f"server-{self.port}.log"
        # Voice loads two more models (and a third process): only the voice tests want it.
        command = [sys.executable, "-m", "frontend.cli", "serve", "--port", str(self.port), *args,
                   *([] if voice else ["--no-voice"])]
        if model is not None:
            command += ["--model", str(model)]
        self.log = open(self.log_path, "w")
        self.process = subprocess.Popen(command, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT,
                                        env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log_text()}")
            try:
                if get_json(self.url + "/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server did not become healthy:\n{self.log_text()}")

    def log_text(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text()[-5000:]

    def worker_pids(self, name: str) -> list[int]:
        out = subprocess.run(["pgrep", "-P", str(self.process.pid), "-f", f"workers.{name}_process"],
                             capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def metric(self, name: str) -> float:
        status, text = request("GET", self.url + "/metrics")
        for line in text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()
        return self.process.returncode


def request(method: str, url: str, body: dict | bytes | None = None, headers: dict | None = None,
            timeout: float = 60.0) -> tuple[int, str]:
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def get_json(url: str, headers: dict | None = None) -> tuple[int, dict]:
    status, text = request("GET", url, headers=headers, timeout=2.0)
    return status, json.loads(text)


def post_json(url: str, body, headers: dict | None = None) -> tuple[int, dict]:
    status, text = request("POST", url, body, {"Content-Type": "application/json", **(headers or {})})
    return status, json.loads(text)


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
