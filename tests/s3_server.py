"""A real S3 API on 127.0.0.1 for the storage tests: moto's standalone server (``moto[server]``) in a process of
its own, reached by s3fs over HTTP as any bucket would be (no in-process mock)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator

KEY, SECRET, REGION = "testing", "testing", "us-east-1"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def moto_server(timeout_s: float = 30.0) -> Iterator[str]:
    """``python -m moto.server`` on a free port of 127.0.0.1 until the block ends; its endpoint URL."""
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    env = {**os.environ, "AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_DEFAULT_REGION": REGION}
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if server.poll() is not None:
                raise RuntimeError(
                    f"moto's server exited ({server.returncode}): {server.stderr.read().decode()[-2000:]}"
                )
            try:
                urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"moto's server did not answer on {endpoint} within {timeout_s} s") from None
                time.sleep(0.1)
        yield endpoint
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def configure(endpoint: str) -> None:
    """Point fsspec's s3:// at ``endpoint`` in this process (fsspec's own configuration: what a user sets)."""
    import fsspec.config

    fsspec.config.conf["s3"] = {
        "endpoint_url": endpoint,
        "key": KEY,
        "secret": SECRET,
    }


def new_bucket() -> str:
    """A fresh, empty bucket (its ``s3://`` URL) on the configured server."""
    import fsspec

    name = f"fleet-{uuid.uuid4().hex[:12]}"
    fsspec.filesystem("s3").mkdir(name)
    return f"s3://{name}"
