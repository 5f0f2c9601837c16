"""A local multi-node Ray cluster in a process of its own, for the crash harness (which forks
its drivers, and so must not hold Ray's threads itself).

    python tools/ray_cluster.py [NODES]   # prints "address <gcs address>" once the nodes are up

Starts `ray.cluster_utils.Cluster`: a head with no CPUs and NODES (2) nodes with one CPU each.
Then reads commands from stdin, one per line, and answers each with one line:
  lose       remove a random worker node without warning, add a replacement -> "lost <node id>"
  remove     remove a random worker node without warning, no replacement -> "removed <node id>"
  add        add a worker node -> "added <node id>"
  lose PID   remove the worker node that runs process PID (a Ray worker: its parent is that
             node's raylet) without warning, add a replacement -> "lost <node id>" ("lost -":
             no node runs it)
  drain PID S  drain the worker node that runs process PID for preemption, with a deadline S
             seconds ahead (as a cloud's spot reclaim does) -> "drained <node id>" ("drained -")
  reclaim ID   the deadline: remove node ID without warning (unless Ray ended it already, as a
             drained node with nothing left on it does), add a replacement -> "reclaimed <ID>"
Ends (and shuts the cluster down) when stdin closes.
"""

from __future__ import annotations

import random
import sys

MB = 2**20


def main() -> int:
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False,
                                                            "object_store_memory": 80 * MB})
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    workers = [cluster.add_node(num_cpus=1, object_store_memory=80 * MB) for _ in range(count)]
    cluster.wait_for_nodes()
    rng = random.Random()
    print("address", cluster.address, flush=True)
    try:
        for line in sys.stdin:
            command, _, pid = line.strip().partition(" ")
            if command in ("lose", "remove"):
                node = _running(workers, pid) if pid else rng.choice(workers)
                if node is None:
                    print("lost -", flush=True)
                    continue
                workers.remove(node)
                cluster.remove_node(node, allow_graceful=False)
                if command == "lose":
                    workers.append(cluster.add_node(num_cpus=1, object_store_memory=80 * MB))
                print("lost" if command == "lose" else "removed", node.node_id, flush=True)
            elif command == "drain":
                pid, _, seconds = pid.partition(" ")
                node = _running(workers, pid)
                if node is not None:
                    _drain(cluster, node.node_id, float(seconds))
                print("drained", node.node_id if node is not None else "-", flush=True)
            elif command == "reclaim":
                node = next((n for n in workers if n.node_id == pid), None)
                if node is not None:
                    workers.remove(node)
                    cluster.remove_node(node, allow_graceful=False)
                    workers.append(cluster.add_node(num_cpus=1, object_store_memory=80 * MB))
                print("reclaimed", pid, flush=True)
            elif command == "add":
                workers.append(cluster.add_node(num_cpus=1, object_store_memory=80 * MB))
                print("added", workers[-1].node_id, flush=True)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()
    return 0


def _drain(cluster, node_id: str, seconds: float) -> None:
    import time

    import ray
    from ray.core.generated import autoscaler_pb2

    reason = autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION")
    deadline_ms = int((time.time() + seconds) * 1000)
    gcs = ray._raylet.GcsClient(address=cluster.gcs_address)
    gcs.drain_node(node_id, reason, "spot reclaim", deadline_ms)


def _running(workers: list, pid: str):
    """The node whose raylet is the parent of process `pid` (a Ray worker), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            parent = int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return next((n for n in workers if n.all_processes["raylet"][0].process.pid == parent), None)


if __name__ == "__main__":
    sys.exit(main())
