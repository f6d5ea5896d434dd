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

from fleet.runtime import rendezvous
from fleet.runtime.roles import RoleInfo
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
    for world in args.worlds:
        times = [join_once(clients, world, secret) for _ in range(args.repeats)]
        print(f"join of {world:3d} ranks: median {statistics.median(times) * 1e3:7.1f} ms (min {min(times) * 1e3:.1f})")
    raw = dist.PrefixStore("raw", clients[0])
    signed = SignedStore(dist.PrefixStore("signed", clients[0]), secrets.token_bytes(32))
    rounds = [(per_call(raw), per_call(signed)) for _ in range(args.repeats)]  # interleaved: the same noise
    print(f"set+get raw    : median {statistics.median(r for r, _ in rounds) * 1e6:7.1f} us")
    print(f"set+get signed : median {statistics.median(s for _, s in rounds) * 1e6:7.1f} us")


if __name__ == "__main__":
    main()
