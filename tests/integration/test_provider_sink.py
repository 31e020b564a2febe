"""The provider sink, a stand-in on loopback: a caller that hung up (a drain whose read timed
out while the sink hung on purpose) is no error of the sink's, and prints no traceback."""

from __future__ import annotations

import pytest

from infrai_local import provider_sink


@pytest.mark.parametrize("error", [BrokenPipeError, ConnectionResetError])
def test_a_caller_that_hung_up_prints_no_traceback(
    error: type[OSError], capsys: pytest.CaptureFixture[str]
) -> None:
    sink = provider_sink.start_in_thread()
    try:
        # Given the sink's answer met a connection its caller had closed
        try:
            raise error(32, "the caller closed the connection")
        except OSError:
            # When the server handles that request's error
            sink.server.handle_error(None, ("127.0.0.1", 40000))  # type: ignore[arg-type]
    finally:
        sink.stop()
    # Then nothing is printed
    assert capsys.readouterr().err == ""


def test_any_other_error_is_still_reported(capsys: pytest.CaptureFixture[str]) -> None:
    sink = provider_sink.start_in_thread()
    try:
        try:
            raise ValueError("a bug in the sink")
        except ValueError:
            sink.server.handle_error(None, ("127.0.0.1", 40000))  # type: ignore[arg-type]
    finally:
        sink.stop()
    assert "a bug in the sink" in capsys.readouterr().err
