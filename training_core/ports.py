"""Where this node's processes listen: the ports (rollout servers, the trainer's rendezvous, the
weight update group) and the address it announces. A leaf module: the launcher, the world and
the transports all take them here."""

from __future__ import annotations

import os
import random
import socket

# The ports a node's processes listen on (rollout servers, the trainer's rendezvous, the weight
# update group): "30000-30999". Cloud nodes set it (cloud-init) to the range their security group
# opens; unset, any free port.
PORT_RANGE_ENV = "OOLONG_PORT_RANGE"
# A node announces the address other nodes reach it at (set by the node's worker); otherwise the
# address this machine uses to reach the first server (transport.weight_sync.node_address).
NODE_ADDRESS_ENV = "OOLONG_NODE_ADDRESS"


def free_port() -> int:
    """A free port: any, or one of the node's range (``OOLONG_PORT_RANGE``)."""
    span = os.environ.get(PORT_RANGE_ENV, "").strip()
    if not span:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    try:
        low, high = (int(x) for x in span.split("-"))
    except ValueError:
        raise ValueError(f"{PORT_RANGE_ENV}={span!r}: expected LOW-HIGH, e.g. 30000-30999") from None
    ports = list(range(low, high + 1))
    random.shuffle(ports)  # concurrent starters on one node rarely try the same port first
    for port in ports:
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {PORT_RANGE_ENV}={span}: widen the range (and the "
                       "security group's server_port_range with it)")
