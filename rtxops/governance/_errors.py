"""The governance exception family."""
from __future__ import annotations


class GovernanceError(Exception):
    """Base of every governance error; the message says what to do."""


class UsageError(GovernanceError):
    """Bad arguments or unreadable input (CLI exit 2)."""


class VerificationError(GovernanceError):
    """A bundle failed one check (CLI exit 1). ``check`` names the check."""

    MAX_MESSAGE = 500   # messages quote the bundle's own (unsigned) text: kept to a line or two

    def __init__(self, check: str, message: str) -> None:
        if len(message) > self.MAX_MESSAGE:
            message = message[:self.MAX_MESSAGE] + f"... ({len(message)} characters)"
        super().__init__(f"{check}: {message}")
        self.check, self.message = check, message


class PolicyDenied(VerificationError):
    def __init__(self, message: str) -> None:
        super().__init__("policy", message)
