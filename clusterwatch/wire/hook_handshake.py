"""The hook socket's credential handshake, as both ends speak it.

Next to the hook socket ``PATH`` the agent listens on ``PATH.cred``. A hook
connects and reads one line: ``ok <nonce>`` or ``error <reason>``; the agent
closes the connection after it. The nonce stands for the kernel's credentials
of that connection (SO_PEERCRED) and goes into the hook's hello
(``HookMessage.credential_nonce``). Shared here so the hook (which must not
import the agent) and the agent cannot disagree on paths or framing.
"""

from __future__ import annotations

from clusterwatch.errors import ClusterwatchError

CREDENTIAL_SOCKET_SUFFIX = ".cred"
# A reply is one short line; anything longer is not the agent talking.
MAX_REPLY_BYTES = 512
_OK = "ok "
_ERROR = "error "


class HandshakeError(ClusterwatchError):
    """No nonce: the agent refused, the credential socket cannot be used, or what answered is no agent."""


def credential_socket_path(hook_socket: str) -> str:
    """Where the agent serving ``hook_socket`` hands out nonces."""
    return hook_socket + CREDENTIAL_SOCKET_SUFFIX


def encode_nonce(nonce: str) -> bytes:
    return f"{_OK}{nonce}\n".encode()


def encode_refusal(reason: str) -> bytes:
    """One line, whatever ``reason`` holds, cut to fit MAX_REPLY_BYTES."""
    line = _ERROR + " ".join(reason.split())
    return line.encode()[: MAX_REPLY_BYTES - 1] + b"\n"


def decode_reply(reply: bytes) -> str:
    """The nonce in the agent's reply.

    Raises:
        HandshakeError: the agent refused (its reason), or the reply is malformed.
    """
    line = reply.decode(errors="replace")
    if not line.endswith("\n"):
        raise HandshakeError("the credential socket closed before a whole reply line")
    line = line[:-1]
    if line.startswith(_OK) and len(line) > len(_OK) and " " not in line[len(_OK) :]:
        return line[len(_OK) :]
    if line.startswith(_ERROR):
        raise HandshakeError(f"the agent refused: {line[len(_ERROR) :]}")
    raise HandshakeError(f"unexpected reply from the credential socket: {line[:80]!r}")
