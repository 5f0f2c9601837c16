"""The sweep callbacks' own state (Ray Tune's `Callback.get_state` / `set_state`): kept in the
sweep manifest, so that each write of it holds the states and the marks of what the callbacks
were given together (see `tune.callback`), and given back to the callbacks of a later fit().

sweep.json's `callback_states` has one entry per callback whose get_state() returned
something other than None: its position in the RunConfig's list of sweep callbacks, its
class name, and the state as JSON where it is plain data (the argument codec, `core.codec`),
else the name of a file under `.unbroken/pickled/callbacks/` holding its cloudpickle bytes,
as the Tuner's arguments that are not plain data are kept. A pickled state's file is named by
the position and a hash of its bytes, and written before the manifest that names it; after a
save, the files that neither that manifest nor the previous generation (the fallback) names
are removed. So whichever generation a restore reads, every state it names is there.

A later fit() matches the states to its callbacks by position, and refuses a callback of
another class at a position that has a state (SweepMismatchError): a state is only ever given
to the kind of callback that made it.
"""

from __future__ import annotations

import hashlib
import logging
import posixpath
from typing import Any

from unbroken.core.codec import decode, encode_or_pickle
from unbroken.errors import SweepMismatchError, UnsavableArgumentError
from unbroken.store.manifest_base import META_DIR
from unbroken.store.pickled import loads, pickle_file
from unbroken.store.storage import Storage
from unbroken.store.sweep_manifest import SweepManifest
from unbroken.tune.callback import Callback

log = logging.getLogger("unbroken")

CALLBACKS_PICKLED = f"{META_DIR}/pickled/callbacks"


def pickled_names(entries: list[dict[str, Any]] | None) -> set[str]:
    """The pickled states' names that the `callback_states` entries refer to."""
    return {e["pickled"] for e in entries or [] if isinstance(e, dict) and e.get("pickled")}


def check_matches(entries: list[dict[str, Any]] | None, callbacks: list[Callback], path: str) -> None:
    """SweepMismatchError if a position with a saved state holds a callback of another class."""
    for entry in entries or []:
        index, name = entry["index"], entry["class"]
        if index < len(callbacks) and type(callbacks[index]).__name__ != name:
            saved = ", ".join(f"{e['index']}: {e['class']}" for e in entries or [])
            raise SweepMismatchError(
                f"the sweep at {path!r} saved the state of a {name} as sweep callback {index}, and this "
                f"fit() gives a {type(callbacks[index]).__name__} there. Hint: give the sweep callbacks in "
                f"the order they were given before (the saved states are of {saved}); a callback added at "
                "the end of the list starts without a state")


class CallbackStates:
    """The states of one fit()'s sweep callbacks, between them and the sweep manifest."""

    def __init__(self, storage: Storage, manifest: SweepManifest, callbacks: list[Callback]) -> None:
        self.storage, self.manifest, self.callbacks = storage, manifest, callbacks
        self._named = pickled_names(manifest.callback_states)  # what the manifest on storage names
        self._written = set(self._named)  # the pickled states known to be on storage

    def restore(self) -> None:
        """Give each saved state to the callback at its position (call it before anything is
        delivered). SweepMismatchError where a callback of another class is there."""
        check_matches(self.manifest.callback_states, self.callbacks, self.storage.url())
        for entry in self.manifest.callback_states or []:
            index = entry["index"]
            if index >= len(self.callbacks):
                log.warning("sweep %s: the state saved for sweep callback %d (%s) is dropped: this fit() "
                            "has %d sweep callbacks", self.manifest.name, index, entry["class"],
                            len(self.callbacks))
                continue
            self.callbacks[index].set_state(self._load(entry))

    def capture(self) -> None:
        """Put every callback's current state into the manifest (just before each save)."""
        before = {e["index"]: e for e in self.manifest.callback_states or []}
        entries = []
        for index, callback in enumerate(self.callbacks):
            try:
                state = callback.get_state()
            except Exception as e:
                log.warning("sweep callback %s.get_state raised %s: %s; its state saved before is kept",
                            type(callback).__name__, type(e).__name__, e)
                if index in before:
                    entries.append(before[index])
                continue
            if state is not None:
                entries.append(self._entry(index, callback, state))
        self.manifest.callback_states = entries or None

    def saved(self) -> None:
        """The manifest was saved: remove the pickled states that neither it nor the previous
        generation names."""
        now = pickled_names(self.manifest.callback_states)
        if now != self._named:
            keep = {posixpath.basename(pickle_file(CALLBACKS_PICKLED, n)) for n in now | self._named}
            for entry in self.storage.listdir(CALLBACKS_PICKLED):
                if entry.endswith(".pkl") and entry not in keep:
                    self.storage.remove(f"{CALLBACKS_PICKLED}/{entry}")
            self._written &= now | self._named
        self._named = now

    def _entry(self, index: int, callback: Callback, state: Any) -> dict[str, Any]:
        entry: dict[str, Any] = {"index": index, "class": type(callback).__name__}
        pickles: dict[str, bytes] = {}
        try:
            encode_or_pickle(state, "", entry, pickles, "state")
        except UnsavableArgumentError as e:
            cause = e.__context__  # what pickling raised
            raise UnsavableArgumentError(
                f"the state sweep callback {index} ({type(callback).__name__}) returned from get_state() can "
                f"be neither stored as JSON nor pickled ({type(cause).__name__}: {cause}), so the sweep "
                "could not give it back when restored. Hint: return plain data (dicts, lists, numbers, "
                "strings) from get_state(), and rebuild the rest in set_state()") from None
        if pickles:
            blob = pickles["state"]
            name = f"{index}-{hashlib.sha256(blob).hexdigest()[:16]}"
            if name not in self._written:
                self.storage.makedirs(CALLBACKS_PICKLED)
                self.storage.write_atomic(pickle_file(CALLBACKS_PICKLED, name), blob)
                self._written.add(name)
            entry["pickled"] = name
        return entry

    def _load(self, entry: dict[str, Any]) -> Any:
        if entry.get("pickled"):
            return loads(self.storage.read_bytes(pickle_file(CALLBACKS_PICKLED, entry["pickled"])))
        return decode(entry["state"])
