"""Typed errors. Every message says what was wrong and what to do about it."""


class NeoError(Exception):
    """Base class of every error the engine raises on purpose."""


class ConfigError(NeoError, ValueError):
    """An engine knob is unknown, malformed or out of range."""


class ModelLoadError(NeoError):
    """The model could not be found or read."""


class InvalidRequestError(NeoError, ValueError):
    """A request (prompt or sampling parameters) is malformed; only that request fails."""


class QueueFullError(NeoError):
    """Admission control refused a request because the waiting queue is full."""


class EngineDeadError(NeoError):
    """The engine loop stopped; no request can make progress."""


class SchedulerError(NeoError):
    """The scheduler broke its own block accounting: an engine bug, not a fault of the request or the config."""


class KernelError(NeoError):
    """The CPU attention library failed to build, load or run."""


class KernelInputError(KernelError, ValueError):
    """Tensors handed to the CPU attention library have the wrong shape, dtype or layout."""
