"""Change feed over Redis pub/sub: every store process sharing the namespace sees every change.

One listener thread per process holds the subscription and hands events to local
subscribers. Each time it (re)subscribes it delivers a ``resync`` event, because anything
published while it was disconnected is lost (pub/sub keeps no history). While Redis is
unreachable, ``publish`` still reaches this process's own subscribers.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import redis

from loraplex.adapter_store.backends.memory_feed import Subscribers
from loraplex.adapter_store.backends.redis_conn import REDIS_DOWN, describe
from loraplex.adapter_store.records import KIND_RESYNC, ChangeEvent

log = logging.getLogger(__name__)


class RedisChangeFeed:
    """Publishes to ``<namespace>:changes``; a background thread listens to it."""

    def __init__(self, client: redis.Redis, namespace: str, reconnect_s: float = 0.5) -> None:
        self._r = client
        self._channel = f"{namespace}:changes"
        self._reconnect_s = reconnect_s
        self._subscribers = Subscribers()
        self._live = threading.Event()
        self._stop = threading.Event()
        self.description = describe(client)
        self._thread = threading.Thread(target=self._listen, name="store-change-feed", daemon=True)
        self._thread.start()

    @property
    def live(self) -> bool:
        """True while the listener holds its subscription."""
        return self._live.is_set()

    def wait_live(self, timeout: float) -> bool:
        return self._live.wait(timeout)

    def publish(self, event: ChangeEvent) -> bool:
        try:
            self._r.publish(self._channel, event.to_json())
            if self._live.is_set():
                return True  # the listener delivers it to this process's subscribers too
        except REDIS_DOWN as e:
            log.warning("change feed: cannot publish to %s (%s); only local watchers see %s",
                        self.description, e, event.adapter_id)
        self._subscribers.deliver(event)
        return False

    def subscribe(self, callback: Callable[[ChangeEvent], None]) -> Callable[[], None]:
        unsubscribe = self._subscribers.add(callback)
        if self._live.is_set():
            callback(ChangeEvent(KIND_RESYNC))  # otherwise the next (re)subscription sends it
        return unsubscribe

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _listen(self) -> None:
        while not self._stop.is_set():
            pubsub = self._r.pubsub()
            try:
                pubsub.subscribe(self._channel)
                self._pump(pubsub)
            except REDIS_DOWN as e:
                if self._live.is_set():
                    log.warning("change feed: lost %s (%s); reconnecting", self.description, e)
                self._live.clear()
                self._stop.wait(self._reconnect_s)
            finally:
                try:
                    pubsub.close()
                except REDIS_DOWN:
                    pass
        self._live.clear()

    def _pump(self, pubsub: redis.client.PubSub) -> None:
        while not self._stop.is_set():
            msg = pubsub.get_message(timeout=0.2)
            if msg is None:
                continue
            if msg["type"] == "subscribe":
                self._live.set()
                log.info("change feed: subscribed to %s on %s", self._channel, self.description)
                self._subscribers.deliver(ChangeEvent(KIND_RESYNC))
            elif msg["type"] == "message":
                try:
                    self._subscribers.deliver(ChangeEvent.from_json(msg["data"]))
                except (ValueError, TypeError) as e:
                    log.warning("change feed: ignoring a malformed message on %s: %s", self._channel, e)
