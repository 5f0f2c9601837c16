"""Preemption notices: word that machines of the run go away at a deadline, and from where.

A notice comes from
- a SIGTERM to the driver, or to a local worker process (that rank's `Terminating` message):
  the machine goes `FailureConfig.sigterm_grace_s` later (a SIGINT is an interrupt, no notice);
- a Ray node drain (the Ray engine, `DrainWatch`): the node's ranks, by the drain's deadline;
- the cloud's spot notice, polled from the metadata endpoint of the driver's machine, only
  when asked (`FailureConfig(preemption_notices="aws"|"gce")` or the environment variable
  `UNBROKEN_PREEMPTION_NOTICES`): AWS's `spot/instance-action` (its `time` is the deadline),
  GCE's `instance/preempted` (TRUE; GCE gives 30 s). `UNBROKEN_METADATA_URL` overrides the
  endpoint's base address; an ordinary machine is never probed.

What follows is the attempt loop's business: the attempt stops at a checkpoint (STOPPING),
the ranks that have not reported in time give their step up (`abandon_at`) so that one of
them saves the last report round just in time, and the attempt ends PREEMPTED, which is not
a failure. A notice for the driver's machine ends the run (INTERRUPTED, to be continued
elsewhere); one for some of its ranks' nodes (a drain) starts the next attempt without them.
"""

from __future__ import annotations

import calendar
import json
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

NOTICES_ENV = "UNBROKEN_PREEMPTION_NOTICES"
METADATA_URL_ENV = "UNBROKEN_METADATA_URL"
METADATA_POLL_S = 2.0
DRAIN_POLL_S = 1.0  # how often a run on Ray asks which of its nodes are drained
GCE_NOTICE_S = 30.0  # GCE stops a preempted VM this long after its notice
# A rank still in its step this share of the notice period before the deadline gives the
# step up, so that the last report round is saved in time (at least ABANDON_MIN_S before).
ABANDON_SHARE, ABANDON_MIN_S = 0.25, 1.0
_BASE = {"aws": "http://169.254.169.254", "gce": "http://metadata.google.internal"}


@dataclass(frozen=True)
class Notice:
    """One preemption notice: what sent it (`source`: "SIGTERM", "SIGTERM to rank 1",
    "aws spot", "gce preempted"), when (`received_at`) and the deadline (time.time()
    seconds), the machine it names (`node`: a Ray node id, or this machine's host name)
    and its ranks (None: every rank)."""

    source: str
    received_at: float
    deadline: float
    node: str
    ranks: tuple[int, ...] | None = None

    @property
    def abandon_at(self) -> float:
        """When ranks that have not reported since the notice give their step up."""
        period = max(0.0, self.deadline - self.received_at)
        return self.deadline - max(ABANDON_MIN_S, ABANDON_SHARE * period)

    def record(self) -> dict[str, Any]:
        """The notice as the attempt record keeps it (`Attempt.preempted`)."""
        return {"source": self.source, "received_at": self.received_at, "deadline": self.deadline,
                "node": self.node, "ranks": list(self.ranks) if self.ranks is not None else None}

    def merged(self, other: Notice) -> Notice:
        """This notice and `other` as one: the earlier deadline, every rank of either."""
        first, second = sorted((self, other), key=lambda n: n.deadline)
        ranks = None if None in (self.ranks, other.ranks) else tuple(sorted({*self.ranks, *other.ranks}))
        node = first.node if first.node == second.node else f"{first.node}, {second.node}"
        return Notice(first.source, first.received_at, first.deadline, node, ranks)

    def info(self, num_workers: int) -> dict[str, Any]:
        """What `train.get_preemption_info()` tells the loop (Ray V2's PreemptionInfo fields)."""
        ranks = list(self.ranks) if self.ranks is not None else list(range(num_workers))
        return {"deadline_ms": int(self.deadline * 1000), "preempted_node_to_ranks": {self.node: ranks}}


def machine_notice(source: str, at: float, grace_s: float) -> Notice:
    """A notice for this machine, every rank on it (a signal to the driver or a local worker)."""
    return Notice(source, at, at + grace_s, socket.gethostname())


class DrainWatch:
    """One attempt's Ray node drains, asked of its group (`draining()`, on the Ray engine) at
    most every DRAIN_POLL_S; `take` returns a notice for each newly drained node's ranks (a
    drain without a deadline gets `grace_s`)."""

    def __init__(self) -> None:
        self._due = 0.0
        self._seen: set[str] = set()

    def take(self, group: Any, now: float, grace_s: float) -> list[Notice]:
        draining = getattr(group, "draining", None)
        if draining is None or now < self._due:
            return []
        self._due = now + DRAIN_POLL_S
        at, notices = time.time(), []
        for node, (deadline, ranks) in draining().items():
            if node not in self._seen:
                self._seen.add(node)
                notices.append(Notice("ray drain", at, deadline or at + grace_s, node, tuple(ranks)))
        return notices


class MetadataWatch:
    """Polls the cloud's metadata endpoint for a spot notice in a thread of its own, when the
    run asks for it (`provider`, else $UNBROKEN_PREEMPTION_NOTICES); `take()` returns the
    notice once."""

    def __init__(self, provider: str | None) -> None:
        self.provider = provider or os.environ.get(NOTICES_ENV) or None
        if self.provider not in (None, *_BASE):
            raise ValueError(f"{NOTICES_ENV} must be one of {sorted(_BASE)}, got {self.provider!r}")
        self.base = (os.environ.get(METADATA_URL_ENV) or _BASE.get(self.provider or "", "")).rstrip("/")
        self._notice: Notice | None = None
        self._taken = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.provider is not None and self._thread is None:
            self._thread = threading.Thread(target=self._poll, name="unbroken-spot-notices", daemon=True)
            self._thread.start()

    def close(self) -> None:
        self._stop.set()

    def take(self) -> Notice | None:
        """The spot notice, the first time it is asked for after it came; else None."""
        if self._notice is None or self._taken:
            return None
        self._taken = True
        return self._notice

    def _poll(self) -> None:
        while self._notice is None and not self._stop.is_set():
            try:
                self._notice = self.check(time.time())
            except (OSError, ValueError):
                pass  # the endpoint did not answer this time: asked again at the next poll
            self._stop.wait(METADATA_POLL_S)

    def check(self, now: float) -> Notice | None:
        """Ask the endpoint once: the notice, or None while there is none."""
        if self.provider == "gce":
            body = self._get("/computeMetadata/v1/instance/preempted", {"Metadata-Flavor": "Google"})
            if body is None or body.strip().upper() != "TRUE":
                return None
            return Notice("gce preempted", now, now + GCE_NOTICE_S, socket.gethostname())
        body = self._get("/latest/meta-data/spot/instance-action", self._aws_token())
        if body is None:
            return None
        action = json.loads(body)
        deadline = calendar.timegm(time.strptime(action["time"], "%Y-%m-%dT%H:%M:%SZ"))
        source = f"aws spot {action.get('action', 'terminate')}"
        return Notice(source, now, float(deadline), socket.gethostname())

    def _aws_token(self) -> dict[str, str]:
        """IMDSv2's session token header, or none where the endpoint takes plain requests."""
        request = urllib.request.Request(f"{self.base}/latest/api/token", method="PUT",
                                         headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"})
        try:
            with urllib.request.urlopen(request, timeout=1.0) as answer:
                return {"X-aws-ec2-metadata-token": answer.read().decode()}
        except (OSError, urllib.error.HTTPError):
            return {}

    def _get(self, path: str, headers: dict[str, str]) -> str | None:
        """The body at `path`; None for a 404 (no notice)."""
        request = urllib.request.Request(self.base + path, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=1.0) as answer:
                return answer.read().decode()
        except urllib.error.HTTPError as error:
            if error.code == 404:
                return None
            raise
