"""The client's ``publish`` refuses an option it does not know, as a keyword argument would."""

from __future__ import annotations

from typing import Any

import pytest

from infrai_jobs.queue.client import InfraiClient


def test_a_misspelt_publish_option_is_refused_before_anything_is_sent() -> None:
    # Given a client for a server that is never reached (nothing listens on port 9)
    client = InfraiClient("http://127.0.0.1:9", "sk_test_key")
    options: dict[str, Any] = {"delay_secs": 30, "retry": False}
    # When a producer publishes with a misspelt option, Then the call fails naming it
    with pytest.raises(TypeError, match=r"unknown options: delay_secs$"):
        client.publish("billing-jobs", {"job": "invoice.finalize"}, **options)
    client.close()
