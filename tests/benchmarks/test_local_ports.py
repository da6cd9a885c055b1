"""Ports for the servers the tests and benchmarks start: distinct, free, and outside the
kernel's ephemeral range, where Ray's processes bind theirs."""

from __future__ import annotations

import socket

from benchmarks.local_ports import HOST, _ephemeral_start, free_ports


def test_ports_are_distinct_free_and_below_the_ephemeral_range():
    ports = free_ports(8)
    assert len(set(ports)) == 8
    assert all(20000 <= p < _ephemeral_start() for p in ports)
    socks = [socket.socket() for _ in ports]
    try:
        for s, p in zip(socks, ports):
            s.bind((HOST, p))
    finally:
        for s in socks:
            s.close()
