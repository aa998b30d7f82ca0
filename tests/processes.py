"""What a test reads about the processes a command started."""
from __future__ import annotations

import psutil


def listening_ips(pid: int) -> set[str]:
    """The addresses pid and its descendants listen on.

    A descendant that ends between the listing of the tree and the reading of its sockets (jupyter's
    and streamlit's short-lived helpers; CI once) listens on nothing: skipped, not an error. An empty
    set is what the caller's assertion sees, so a server that is not listening still fails it."""
    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return set()
    ips: set[str] = set()
    for p in tree:
        try:
            ips |= {c.laddr.ip for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
        except psutil.NoSuchProcess:  # ZombieProcess included
            continue
    return ips
