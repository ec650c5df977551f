"""pergrad's logger, and the warnings it gives once per object."""

from __future__ import annotations

import logging
import threading
import weakref

LOGGER = logging.getLogger("pergrad")

# The messages each object has logged. Keyed weakly, so that an object's set goes
# with it (the sets hold strings only, no reference back); a lock, since models are
# trained in several threads (tf.distribute's replicas, or the user's).
_LOGGED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def warn_once(owner, message: str) -> None:
    """Logs ``"pergrad: {message}."`` as a warning the first time ``owner`` gives ``message``."""
    with _LOCK:
        logged = _LOGGED.setdefault(owner, set())
        if message in logged:
            return
        logged.add(message)
    LOGGER.warning("pergrad: %s.", message)
