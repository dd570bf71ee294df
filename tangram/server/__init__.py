"""Scale-out: `tangram serve` (one orchestrator for many rollout processes) and
`tangram.Client` (the orchestrator's API over TCP). See docs/server.md."""

from .client import Client, ClientHandle, SyncClient, SyncClientHandle
from .protocol import (
    DEFAULT_MAX_FRAME,
    DEFAULT_PORT,
    AuthenticationError,
    ConnectionLost,
    FrameTooLarge,
    ProtocolError,
    RemoteError,
    ServerUnreachable,
)
from .command import cli_main
from .server import Server

__all__ = [
    "AuthenticationError", "Client", "ClientHandle", "ConnectionLost", "DEFAULT_MAX_FRAME", "DEFAULT_PORT",
    "FrameTooLarge", "ProtocolError", "RemoteError", "Server", "ServerUnreachable", "SyncClient", "SyncClientHandle",
    "cli_main",
]
