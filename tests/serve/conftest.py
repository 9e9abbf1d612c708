"""Starting and stopping scripts/serve.py as a subprocess on 127.0.0.1 (bounded waits, always stopped)."""

import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A running scripts/serve.py: its process, base URL and output so far (a file)."""

    def __init__(self, args: list[str], log: pathlib.Path, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self._out = open(log, "w")
        env = dict(os.environ, PYTHONPATH=str(REPO), **(env or {}))
        self.proc = subprocess.Popen([sys.executable, str(REPO / "scripts" / "serve.py"), *args, "--host", "127.0.0.1",
                                      "--port", str(self.port)], cwd=REPO, env=env, stdout=self._out,
                                     stderr=subprocess.STDOUT)
        self.warming_status = None  # status of a completion sent while /health said 503

    def output(self) -> str:
        return self.log.read_text()

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Poll /health until 200; the first completion sent while it answers 503 is recorded."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"serve.py exited with {self.proc.returncode}:\n{self.output()[-4000:]}")
            try:
                status = httpx.get(self.url + "/health", timeout=5).status_code
            except httpx.TransportError:
                time.sleep(0.2)
                continue
            if status == 200:
                return
            if self.warming_status is None:
                r = httpx.post(self.url + "/v1/completions", json={"prompt": "1+1=", "max_tokens": 1}, timeout=10)
                self.warming_status = (r.status_code, r.json())
            time.sleep(0.2)
        self.stop()
        pytest.fail(f"serve.py was not ready after {timeout} s:\n{self.output()[-4000:]}")

    def stop(self, sig=signal.SIGTERM, timeout: float = 60.0) -> int:
        """Signal the server and wait for it (killed when it does not exit in time); its return code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._out.close()
        return self.proc.returncode


@pytest.fixture(scope="session")
def start_server(tmp_path_factory):
    """start_server(args, env=None) -> a ready ServerProcess; every one is stopped at the end."""
    started = []

    def start(args, env=None):
        server = ServerProcess(args, tmp_path_factory.mktemp("serve") / "serve.log", env)
        started.append(server)
        server.wait_ready()
        return server

    yield start
    for server in started:
        server.stop()
