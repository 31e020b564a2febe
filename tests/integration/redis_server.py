"""Waiting for a redis-server a test started, shared by the second layer's fixtures."""

from __future__ import annotations

import subprocess
import time

import redis


def wait_for_redis(url: str, process: subprocess.Popen[bytes]) -> None:
    """Return once the server at ``url`` answers PING; raise if it died or took 10 s."""
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + 10
    try:
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
    finally:
        client.close()
