"""The project's exception family. Every exception hetps raises on purpose
derives from `HetpsError`, so a caller embedding hetps can catch them all in
one clause; each subsystem adds its own subclass (ConfigError, ProtocolError,
TransportError, SecurityError, RemoteError, RequestTimeout, ...).

Imports nothing of hetps, so every module may import it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .ops import Status


class HetpsError(Exception):
    """Base of every exception hetps raises on purpose."""


class ConfigError(HetpsError, ValueError):
    """One or more configuration values are missing, unknown, of the wrong type
    or out of range. `errors` holds one line per problem (`key: what is wrong`);
    str() joins them with newlines."""

    def __init__(self, errors: str | list[str]):
        self.errors = [errors] if isinstance(errors, str) else list(errors)
        super().__init__("\n".join(self.errors))


class ProtocolError(HetpsError):
    """A message failed validation; `status` says why, `req_id` is echoed if known."""

    def __init__(self, status: Status, message: str, req_id: int = 0):
        super().__init__(f"{status.name}: {message}")
        self.status = status
        self.message = message
        self.req_id = req_id


class UnexpectedReply(HetpsError):
    """A peer answered a request with a message of another kind than the
    protocol prescribes (e.g. PARAMS to a REGISTER): a peer bug or a mix-up
    of addresses, never an assertion."""

    def __init__(self, peer: str, op: str, expected: str, got: object):
        got_name = getattr(getattr(got, "OP", None), "name", type(got).__name__)
        super().__init__(f"{peer} answered {op} with {got_name}, expected {expected}")
        self.peer, self.op, self.expected = peer, op, expected
