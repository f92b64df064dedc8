"""Every error llmgw raises on purpose derives from LlmgwError.

Each carries a message fit for the operator. The CLI turns them into text and an exit
status in one place (cli.py); nothing else prints tracebacks for them.

The exit statuses, chosen here once (docs/operating.md, "Exit codes", lists them):
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILED = 1  # the server refused the request (no such deployment, a bad value, ...)
EXIT_USAGE = 2  # a command line, configuration or key file to fix; a port that is taken
EXIT_IDENTITY = 3  # identity: our key refused, or the server is not the one its key names
EXIT_UNREACHABLE = 4  # nothing (or no leader) answered within the timeout
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT), as shells report it


class LlmgwError(Exception):
    """Root of llmgw's own errors. `exit_code` is what the CLI exits with."""

    exit_code = EXIT_FAILED


class InternalError(LlmgwError):
    """A bug of ours (a lifecycle table asked for a transition it does not have), not the
    operator's mistake: logged with its traceback by the shell that caught it, and by the
    CLI when it ends a command."""


class UsageError(LlmgwError):
    """A command line that does not make sense."""

    exit_code = EXIT_USAGE


class ListenError(LlmgwError):
    """A daemon cannot listen where its configuration says (the port is taken, the
    address is not this machine's): a configuration to fix."""

    exit_code = EXIT_USAGE


class ConfigError(LlmgwError):
    """A configuration file that is wrong: names the file, the key path and the value."""

    exit_code = EXIT_USAGE

    def __init__(self, path: str, key: str, message: str) -> None:
        self.path = path
        self.key = key
        self.detail = message
        where = f"{path}: {key}: " if key else f"{path}: "
        super().__init__(where + message)


class KeyFileError(LlmgwError):
    """A CURVE key file that is missing, unreadable or malformed."""

    exit_code = EXIT_USAGE


class DeploymentError(ConfigError):
    """A deployment file that does not validate."""


class DiscoveryError(LlmgwError):
    """Discovery found the node contradicting its configuration (e.g. a missing HCA)."""

    exit_code = EXIT_USAGE


class ProtocolError(LlmgwError):
    """A message that cannot be decoded or is not allowed where it arrived.

    `request_id` is set when the message was a request whose id could be read, so that
    the sender can be answered rather than left to time out."""

    def __init__(self, message: str, request_id: str = "") -> None:
        super().__init__(message)
        self.request_id = request_id


class IdentityError(LlmgwError):
    """Who we are or who the server is did not check out. Final: never retried."""

    exit_code = EXIT_IDENTITY


class RefusedError(IdentityError):
    """The server refused us, with its reason (a Refused message, or the ZAP handler
    turning our key away in the CURVE handshake)."""


class HandshakeError(IdentityError):
    """The CURVE handshake failed on the server's side of it: the server_key we hold is
    not that server's, or the peer is not an llmgw server."""


class ServerUnreachableError(LlmgwError):
    """No answer from the server within the timeout."""

    exit_code = EXIT_UNREACHABLE


class RequestFailedError(LlmgwError):
    """The server answered a ctl request with an error."""

    exit_code = EXIT_FAILED


class EngineError(LlmgwError):
    """An engine spec that cannot be turned into a launch plan on this node."""
