"""Exceptions shared across proto modules."""
from __future__ import annotations

from .messages import Status


class ConfigError(ValueError):
    """A configuration value is missing, unknown or of the wrong type."""


class ProtocolError(Exception):
    """A message failed validation; `status` says why, `req_id` is echoed if known."""

    def __init__(self, status: Status, message: str, req_id: int = 0):
        super().__init__(f"{status.name}: {message}")
        self.status = status
        self.message = message
        self.req_id = req_id
