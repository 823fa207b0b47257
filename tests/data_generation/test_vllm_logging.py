"""The hub client's retry warnings stay off the console (#50 item 12: an unknown model id
offline printed a long MaxRetryError warning per retry before the one error line)."""

from __future__ import annotations

import logging

from speculators_vllm016.data_generation.vllm_logging import HUB_RETRY_LOGGER, keep_vllm_quiet


def test_the_hub_retry_warnings_are_kept_off(caplog, monkeypatch):
    import huggingface_hub.utils._http as hub_http

    assert hub_http.logger.name == HUB_RETRY_LOGGER  # the logger that warns on each retry
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "WARNING")
    previous = logging.getLogger(HUB_RETRY_LOGGER).level
    try:
        keep_vllm_quiet()
        with caplog.at_level(logging.INFO):
            hub_http.logger.warning("Retrying in 8s [Retry 4/5].")
            hub_http.logger.error("an error still shows")
        assert [r.getMessage() for r in caplog.records] == ["an error still shows"]
    finally:
        logging.getLogger(HUB_RETRY_LOGGER).setLevel(previous)
