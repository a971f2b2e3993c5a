"""Shared test set-up. Triton runs in its interpreter on machines without CUDA; the variable
must be set before anything imports triton (vLLM does), so it is set here, first."""
import os
import shutil

if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


class RedisServer:
    """A real redis-server on a free port, its data (AOF, fsync per write) in a temp folder."""

    def __init__(self, directory, port: int | None = None, extra: tuple[str, ...] = ()):
        import socket

        if port is None:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        self.port, self.directory, self.extra = port, directory, extra
        self.url = f"redis://127.0.0.1:{port}/0"
        self.proc = None

    def start(self) -> "RedisServer":
        import subprocess
        import time

        import redis

        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory),
             "--appendonly", "yes", "--appendfsync", "always", "--save", "", *self.extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:
            try:
                redis.Redis(port=self.port, socket_connect_timeout=0.2).ping()
                return self
            except redis.AuthenticationError:
                return self  # up, and asking for a password
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on port {self.port}")
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: redis flushes the AOF and exits
            self.proc.wait(timeout=20)


def require_redis_server() -> None:
    if shutil.which("redis-server") is None:
        if os.environ.get("CI"):
            raise RuntimeError("redis-server is not installed; .ci/run installs it")
        pytest.skip("redis-server is not installed (apt-get install redis-server)")


@pytest.fixture
def redis_server(tmp_path):
    require_redis_server()
    server = RedisServer(tmp_path).start()
    yield server
    server.stop()
