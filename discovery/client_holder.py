"""One lazily connected aetcd client, shared by Registration and InstanceWatcher.

Both reconnect by dropping the client after an error and asking for a fresh one; the
client is created inside the running event loop (a grpc.aio channel belongs to its loop).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

import aetcd

logger = logging.getLogger(__name__)


class ClientHolder:
    def __init__(self, factory: Callable[[], Awaitable[aetcd.Client]], rpc_timeout: float) -> None:
        self._factory = factory
        self._rpc_timeout = rpc_timeout
        self._client: aetcd.Client | None = None

    async def get(self) -> aetcd.Client:
        """The current client, creating and connecting one if there is none."""
        if self._client is None:
            client = await self._factory()
            await client.connect()  # builds the stubs if a factory returned a fresh client
            self._client = client
        return self._client

    async def drop(self) -> None:
        """Close and forget the client (best effort, bounded by rpc_timeout seconds)."""
        client, self._client = self._client, None
        if client is not None:
            try:
                await asyncio.wait_for(client.close(), self._rpc_timeout)
            except Exception as exc:  # noqa: BLE001 - closing is best effort
                logger.debug("closing etcd client failed: %s", exc)
