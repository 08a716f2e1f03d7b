"""Errors raised by the runtime package."""
from __future__ import annotations


class RuntimeErrorBase(Exception):
    """Base class of every error the runtime raises on purpose."""


class PlanError(RuntimeErrorBase, ValueError):
    """A plan is malformed, refers to unknown ops/variants, or is older than the running one."""


class PlanVersionConflict(PlanError):
    """A plan is not newer than the one published for its job meanwhile (another publisher won
    the race): derive it again from the current plan."""


class PlanNotIssued(PlanError):
    """A plan was not refused but could not be issued now (the disk, the ledger): try again."""


class RegistryError(RuntimeErrorBase, KeyError):
    """An op or variant name is not registered."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""
