"""Errors as the user reads them: one plain sentence each; tracebacks go to the server log only."""
from __future__ import annotations

from engine.core.sampling import SamplingError
from engine.core.trace import TraceError
from engine.decoder import PromptError
from engine.models import ModelLoadError
from engine.strategies.base import StrategyError
from engine.verify import VerificationError


class UserError(Exception):
    """A problem to show the user as a plain message."""


# The engine's own "you asked for something impossible" errors: their text is already written for a user.
USER_FACING = (UserError, PromptError, StrategyError, SamplingError, VerificationError, TraceError)


def out_of_memory(err: BaseException) -> bool:
    """Python's MemoryError, or torch's OutOfMemoryError (known by name: treeviz never imports torch itself)."""
    return isinstance(err, MemoryError) or any(cls.__name__ == "OutOfMemoryError" for cls in type(err).__mro__)


def friendly_error(err: BaseException, context: str = "") -> str:
    """One clear sentence for the user; the traceback goes to the server log only."""
    if out_of_memory(err):
        return ("Out of memory: lower the node budget (N_max / budget), the tree depth or max new tokens, "
                "or choose a smaller model pair.")
    if isinstance(err, USER_FACING):
        return str(err)
    if isinstance(err, ModelLoadError):
        return f"Could not load the models: {err}"
    if context == "load":
        return f"Could not load the models ({type(err).__name__}): {err}"
    return f"{context + ': ' if context else ''}{type(err).__name__}: {err}"
