"""Exceptions shared across proto modules."""
from __future__ import annotations

from .messages import Status


class ConfigError(ValueError):
    """One or more configuration values are missing, unknown, of the wrong type
    or out of range. `errors` holds one line per problem (`key: what is wrong`);
    str() joins them with newlines."""

    def __init__(self, errors: str | list[str]):
        self.errors = [errors] if isinstance(errors, str) else list(errors)
        super().__init__("\n".join(self.errors))


class ProtocolError(Exception):
    """A message failed validation; `status` says why, `req_id` is echoed if known."""

    def __init__(self, status: Status, message: str, req_id: int = 0):
        super().__init__(f"{status.name}: {message}")
        self.status = status
        self.message = message
        self.req_id = req_id
