"""The test servers themselves (tools/benchlib/valkey.py, tests/valkey_servers.py): ports nobody
else is handed, a start that never mistakes another process's server for ours, clusters that do
not vote a stalled node out."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests import valkey_servers
from tests.valkey_servers import ValkeyCluster
from tools.benchlib.valkey import CLUSTER_NODE_TIMEOUT_MS, PORT_LOCK_DIR, PortLease, ValkeyServer

valkey_cluster = valkey_servers.valkey_cluster


def test_a_leased_port_is_nobody_elses() -> None:
    """Outside the kernel's ephemeral range (no bind(0) nor outgoing connection gets it) and
    locked against another process leasing it."""
    lease = PortLease()
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        assert not low <= lease.port <= high
        probe = (
            "import fcntl, os, sys\n"
            f"fd = os.open(os.path.join({PORT_LOCK_DIR!r}, '{lease.port}'), os.O_RDWR)\n"
            "try:\n"
            "    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
            "except BlockingIOError:\n"
            "    sys.exit(7)\n"
        )
        locked = subprocess.run([sys.executable, "-c", probe], check=False, timeout=60)
        assert locked.returncode == 7
    finally:
        lease.close()
    assert subprocess.run([sys.executable, "-c", probe], check=False, timeout=60).returncode == 0


def test_another_process_on_our_port_fails_the_start() -> None:
    """Our server cannot bind a port another server listens on and exits; that other server
    answers the readiness PING. The start must fail, not hand the test a stranger (a
    cluster-enabled one took our slots and MEETs: "cluster not ok after 30.0 s")."""
    stranger = ValkeyServer(cluster=True).start()
    ours = ValkeyServer(port=stranger.port, cluster=True)
    try:
        with pytest.raises(RuntimeError, match="another process|exited"):
            ours.start()
    finally:
        ours.cleanup()
        stranger.cleanup()


def test_cluster_nodes_do_not_vote_a_stalled_node_out(valkey_cluster: ValkeyCluster) -> None:
    """A node stalled past cluster-node-timeout (by a busy machine, or stopped on purpose by a
    test) is voted FAIL, and the cluster refuses every query until 2 x that timeout after it
    answers again (32 s after a 17 s stop with valkey's 15 s default); test clusters have no
    replica to fail over to, so their timeout outlasts any test."""
    for node in valkey_cluster.nodes:
        got = node.client().config_get("cluster-node-timeout")["cluster-node-timeout"]
        assert int(got) == CLUSTER_NODE_TIMEOUT_MS >= 600_000
