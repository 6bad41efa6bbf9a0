"""A free TCP port on localhost (servers and torch.distributed rendezvous started by tests)."""

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
