"""Which link a job waits on: the rule that names a slow link or peer host in the timing report (pure, no torch).

Each worker's summary carries, per peer on another host, the bytes it sent and received and the seconds its
connections to that peer spent with data the link had not yet delivered (:mod:`fleet.telemetry.links`).
:func:`link_summary` adds them up over the workers of one report (fleetrun's: the workers of its node) and
applies the rule:

- **communication dominates** when the workers' communication / wait (the table's ``comm``) is more than
  :data:`COMM_DOMINATES` of their step time, summed over the workers;
- the report then names the peer it waits on: the one whose connections spent the most link time (bytes
  where the kernel keeps no link time), with its bytes per step and the rate it delivered while busy;
- it says the *link* is what the job waits on only when that peer's link time is at least
  :data:`LINK_BOUND` of the communication time per step (see there why a quarter). Otherwise the workers waited with the links idle:
  on their peers themselves (a slower host or a straggler, which the straggler watch names), and the report
  says so instead of blaming a link.

A report whose workers talk to no other host has no ``links`` entry and prints nothing new.
"""

from __future__ import annotations

from typing import Any

COMM_DOMINATES = 0.5
"""Communication dominates the step above this share of the step time."""
LINK_BOUND = 0.25
"""The busiest link explains the wait when its link time per step is at least this share of comm per step. The
link time counts only what this side sends: in a request-reply exchange (a parameter-server pull and push) the
link carries about as much back, so a link that explains the whole wait shows about half of it here; a wait on
a peer's computation leaves the links all but idle (a few per cent)."""


def _peer_label(peer: str) -> str:
    """``host 10.0.0.2`` for a host, ``server 10.0.0.2:6170`` for a parameter server's endpoint."""
    endpoint = peer.startswith("[") or peer.count(":") == 1  # an IPv6 host alone has several colons, no brackets
    return f"server {peer}" if endpoint else f"host {peer}"


def link_summary(records: dict[int, dict[str, Any]]) -> dict[str, Any] | None:
    """The report's ``links`` entry from the workers' summaries (None: no worker talked to another host)."""
    with_links = {rank: r for rank, r in records.items() if r.get("links") and r.get("steps")}
    if not with_links:
        return None
    steps = max(r["steps"] for r in with_links.values())
    step_s = sum(r["run"]["step_s_total"] for r in records.values())
    comm_s = sum(r["run"]["comm_s_total"] for r in records.values())
    share = comm_s / step_s if step_s > 0 else 0.0
    comm_per_step = comm_s / sum(r["steps"] for r in records.values())
    totals: dict[str, dict[str, Any]] = {}
    for record in with_links.values():
        for peer, row in record["links"].items():
            total = totals.setdefault(peer, {"sent": 0, "received": 0, "busy_s": 0.0, "timed": True, "workers": 0})
            total["sent"] += row.get("sent_bytes", 0)
            total["received"] += row.get("received_bytes", 0)
            total["timed"] &= row.get("busy_s") is not None
            total["busy_s"] += row.get("busy_s") or 0.0
            total["workers"] += 1
    peers = {}
    for peer, total in totals.items():
        busy = total["busy_s"] if total["timed"] else None
        peers[peer] = {
            "label": _peer_label(peer),
            "bytes_per_step": (total["sent"] + total["received"]) / steps,
            "sent_bytes_per_step": total["sent"] / steps,
            "received_bytes_per_step": total["received"] / steps,
            # a worker's link time per step, as the table's comm column is a worker's wait per step
            "link_s_per_step": None if busy is None else busy / (steps * total["workers"]),
            "sent_bytes_per_s": total["sent"] / busy if busy else None,
        }

    def weight(peer: str) -> tuple[float, float]:
        row = peers[peer]
        return (row["link_s_per_step"] or 0.0, row["bytes_per_step"])

    busiest = max(peers, key=weight)
    link_s = peers[busiest]["link_s_per_step"]
    out: dict[str, Any] = {
        "comm_share": share,
        "comm_s_per_step": comm_per_step,
        "step_s_per_step": step_s / sum(r["steps"] for r in records.values()),
        "dominates": share > COMM_DOMINATES,
        "waiting_on": busiest if share > COMM_DOMINATES else None,
        "link_bound": None if link_s is None else link_s >= LINK_BOUND * comm_per_step,
        "peers": peers,
    }
    out["message"] = describe(out)
    return out


def _secs(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds >= 0.1 else f"{seconds * 1e3:.1f} ms"


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.2f} MB" if nbytes >= 1e4 else f"{nbytes / 1e3:.1f} kB"


def describe(summary: dict[str, Any]) -> str | None:
    """The report's line about the slow link (None when communication does not dominate)."""
    peer = summary["waiting_on"]
    if peer is None:
        return None
    row = summary["peers"][peer]
    head = (
        f"communication took {summary['comm_share']:.0%} of the step time "
        f"({_secs(summary['comm_s_per_step'])} of {_secs(summary['step_s_per_step'])} per step)"
    )
    traffic = f"{_mb(row['bytes_per_step'])} per step exchanged with it"
    if row["link_s_per_step"] is None:  # no link time from this kernel: the peer with the most bytes
        return f"{head}; the most traffic went to {row['label']}: {traffic} (this kernel times no link)"
    rate = row["sent_bytes_per_s"]
    speed = f", sent at {_mb(rate)}/s" if rate else ""
    busy = f"its connections busy sending {_secs(row['link_s_per_step'])} per step"
    if summary["link_bound"]:
        return f"{head}: most of it waiting on the link to {row['label']}: {traffic}{speed} ({busy})"
    return (
        f"{head}, but the links to other hosts were idle for most of it (the busiest, to {row['label']}: {busy}, "
        f"{traffic}): the workers waited on their peers themselves (a slower host or worker), not on a link"
    )
