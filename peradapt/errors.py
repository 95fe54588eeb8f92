"""Errors a user can cause. The CLI prints each as one line and exits with code 2."""


class PeradaptError(Exception):
    """Base class: the message says what is wrong and what to do about it."""


class ConfigError(PeradaptError):
    """A flag, config file or combination of settings is invalid."""


class DataError(PeradaptError):
    """A dataset is missing, unreadable or too small for what was asked."""


class WeightsError(PeradaptError):
    """Backbone weights or an adapter checkpoint are missing, unreadable or do not match."""


class RunError(PeradaptError):
    """A run directory is missing, incomplete or belongs to a different configuration."""


class TrainingDiverged(PeradaptError):
    """A loss became NaN or infinite."""


class HubError(PeradaptError):
    """The Hugging Face Hub refused an upload (`export --push-to-hub`) or could not be reached."""


class Interrupted(Exception):
    """Ctrl-C stopped a command; the message says what was kept and how to continue. The CLI exits with 130."""
