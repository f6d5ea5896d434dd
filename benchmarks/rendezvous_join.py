"""What the authenticated rendezvous costs: fleet.runtime.rendezvous.join for N ranks, and a signed get/set.

Ranks are threads of this process, each with its own connection to one TCPStore on 127.0.0.1
(the protocol is the same a process runs; the numbers include Python's GIL). Prints the
median over ``--repeats`` joins per world size, and the per-call cost of a value through
SignedStore next to the raw store.

    python benchmarks/rendezvous_join.py [--worlds 2 8 16] [--repeats 7]
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import threading
import time
from datetime import timedelta

import torch.distributed as dist
from _common import record_result

from fleet.roles import RoleInfo
from fleet.runtime import rendezvous
from fleet.runtime.signed_store import SignedStore


def join_once(clients: list[dist.Store], world: int, secret: bytes) -> float:
    namespace = f"bench-{secrets.token_hex(4)}"
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        role = RoleInfo(worker_index=rank, worker_num=world, rank=rank, world_size=world, master="127.0.0.1:1")
        try:
            rendezvous.join(dist.PrefixStore(namespace, clients[rank]), role, secret, 30.0, same_secret=True)
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - start


def per_call(store: dist.Store, calls: int = 500) -> float:
    start = time.perf_counter()
    for i in range(calls):
        store.set(f"k{i % 16}", b"127.0.0.1:6170")
        store.get(f"k{i % 16}")
    return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 8, 16])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    host = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    # One process opening many connections to one store waits 5 s on every 25th: keep to max(worlds).
    clients = [
        dist.TCPStore("127.0.0.1", host.port, None, False, timeout=timedelta(seconds=30))
        for _ in range(max(args.worlds))
    ]
    secret = secrets.token_bytes(32)
    joins = {}
    for world in args.worlds:
        times = [join_once(clients, world, secret) for _ in range(args.repeats)]
        joins[world] = round(statistics.median(times) * 1e3, 2)
        print(f"join of {world:3d} ranks: median {statistics.median(times) * 1e3:7.1f} ms (min {min(times) * 1e3:.1f})")
    raw = dist.PrefixStore("raw", clients[0])
    signed = SignedStore(dist.PrefixStore("signed", clients[0]), secrets.token_bytes(32))
    rounds = [(per_call(raw), per_call(signed)) for _ in range(args.repeats)]  # interleaved: the same noise
    raw_us = statistics.median(r for r, _ in rounds) * 1e6
    signed_us = statistics.median(s for _, s in rounds) * 1e6
    print(f"set+get raw    : median {raw_us:7.1f} us")
    print(f"set+get signed : median {signed_us:7.1f} us")
    record_result(
        "rendezvous_join",
        variant=f"join of {', '.join(map(str, args.worlds))} ranks; signed set+get",
        figure="a value's set+get through SignedStore vs the raw store; the median join per world size",
        units="us",
        fleet=round(signed_us, 1),
        peer="raw TCPStore set+get",
        peer_value=round(raw_us, 1),
        ratio=round(signed_us / raw_us, 3),
        ratio_means="signed / raw per-call time (lower is better)",
        summary=f"signed set+get {signed_us:.0f} us vs {raw_us:.0f} us raw; join "
        + ", ".join(f"{w} ranks {ms:.0f} ms" for w, ms in joins.items()),
        details={"join_median_ms": joins, "repeats": args.repeats},
    )


if __name__ == "__main__":
    main()
