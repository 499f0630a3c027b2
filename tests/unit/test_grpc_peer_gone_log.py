"""grpc aio's ERROR for a send on a call whose client has gone (engine/server/app.py
PeerGoneFilter): DEBUG, not an error with a traceback in the daemon's log; every other grpc
error stays as it is."""

from __future__ import annotations

import logging

import pytest

from engine.server.app import GRPC_AIO_LOGGER, PEER_GONE, PeerGoneFilter, quiet_peer_gone


def _failed_send() -> BaseException:
    try:
        raise RuntimeError('Failed "execute_batch": (SendMessageOperation,)')
    except RuntimeError as e:
        return e


def test_a_send_to_a_gone_client_is_debug_and_other_errors_stay(caplog: pytest.LogCaptureFixture):
    quiet_peer_gone()
    quiet_peer_gone()  # once only
    grpc_log = logging.getLogger(GRPC_AIO_LOGGER)
    assert sum(isinstance(f, PeerGoneFilter) for f in grpc_log.filters) == 1
    e = _failed_send()
    with caplog.at_level(logging.INFO, logger=GRPC_AIO_LOGGER):
        grpc_log.error(
            f"{PEER_GONE} [/hicache.v1.GenerationService/Generate]",
            exc_info=(type(e), e, e.__traceback__),
        )
        grpc_log.error("Unexpected [ValueError] raised by servicer method [/x]")
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("ERROR", "Unexpected [ValueError] raised by servicer method [/x]")
    ]
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger=GRPC_AIO_LOGGER):
        grpc_log.error(f"{PEER_GONE} [/hicache.v1.GenerationService/Generate]")
    assert [r.levelname for r in caplog.records] == ["DEBUG"]
