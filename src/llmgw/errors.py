"""Every error llmgw raises on purpose derives from LlmgwError.

Each carries a message fit for the operator. The CLI turns them into text and an exit
status in one place (cli.py); nothing else prints tracebacks for them.
"""

from __future__ import annotations


class LlmgwError(Exception):
    """Root of llmgw's own errors. `exit_code` is what the CLI exits with."""

    exit_code = 1


class UsageError(LlmgwError):
    """A command line that does not make sense."""

    exit_code = 2


class ConfigError(LlmgwError):
    """A configuration file that is wrong: names the file, the key path and the value."""

    exit_code = 2

    def __init__(self, path: str, key: str, message: str) -> None:
        self.path = path
        self.key = key
        self.detail = message
        where = f"{path}: {key}: " if key else f"{path}: "
        super().__init__(where + message)


class KeyFileError(LlmgwError):
    """A CURVE key file that is missing, unreadable or malformed."""

    exit_code = 2


class DeploymentError(ConfigError):
    """A deployment file that does not validate."""


class DiscoveryError(LlmgwError):
    """Discovery found the node contradicting its configuration (e.g. a missing HCA)."""

    exit_code = 2


class ProtocolError(LlmgwError):
    """A message that cannot be decoded or is not allowed where it arrived.

    `request_id` is set when the message was a request whose id could be read, so that
    the sender can be answered rather than left to time out."""

    def __init__(self, message: str, request_id: str = "") -> None:
        super().__init__(message)
        self.request_id = request_id


class RefusedError(LlmgwError):
    """The server refused us, with its reason. Final: never retried."""

    exit_code = 3


class ServerUnreachableError(LlmgwError):
    """No answer from the server within the timeout."""

    exit_code = 4


class RequestFailedError(LlmgwError):
    """The server answered a ctl request with an error."""

    exit_code = 1


class EngineError(LlmgwError):
    """An engine spec that cannot be turned into a launch plan on this node."""
