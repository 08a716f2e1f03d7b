"""The governance exception family."""
from __future__ import annotations


class GovernanceError(Exception):
    """Base of every governance error; the message says what to do."""


class UsageError(GovernanceError):
    """Bad arguments or unreadable input (CLI exit 2)."""


class VerificationError(GovernanceError):
    """A bundle failed one check (CLI exit 1). ``check`` names the check."""

    def __init__(self, check: str, message: str) -> None:
        super().__init__(f"{check}: {message}")
        self.check, self.message = check, message


class PolicyDenied(VerificationError):
    def __init__(self, message: str) -> None:
        super().__init__("policy", message)
