"""Sandbox networks from Python: create arguments, live policy, exposed ports and
counters (jail engine; the traffic scenarios are in cube-core/tests/network.rs)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from typing import List, Optional

import pytest

import cubesandbox
from cubesandbox import Sandbox

from conftest import new_sandbox


def _needs_ebpf() -> None:
    if shutil.which("ip") is None:
        pytest.skip("skipping: iproute2 (`ip`) is missing")


def _host_address() -> Optional[str]:
    """A non-loopback IPv4 address of this host, if it has one."""
    out = subprocess.run(
        ["ip", "-4", "-o", "addr", "show", "scope", "global"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    for line in out.splitlines():
        fields = line.split()
        if "inet" in fields:
            return fields[fields.index("inet") + 1].split("/")[0]
    return None


def _interfaces(sb: Sandbox) -> List[str]:
    script = "import socket; print(' '.join(n for _, n in socket.if_nameindex()))"
    return sb.commands.run(f'python3 -c "{script}"').stdout.split()


def _networked(**kwargs: object) -> Sandbox:
    _needs_ebpf()
    try:
        return new_sandbox(**kwargs)
    except cubesandbox.SandboxError as e:
        if "eBPF" in str(e) or "bpf" in str(e) or "datapath" in str(e):
            pytest.skip(f"skipping: the eBPF datapath cannot load here: {e}")
        raise


def test_a_sandbox_without_a_network_has_loopback_only(sandbox: Sandbox) -> None:
    assert _interfaces(sandbox) == ["lo"]
    with pytest.raises(cubesandbox.SandboxError):
        sandbox.network.info()


def test_network_policy_ports_and_counters() -> None:
    sb = _networked(
        network=True, deny_out=["203.0.113.0/24"], expose=["18765:8000"]
    )
    try:
        assert sorted(_interfaces(sb)) == ["eth0", "lo"]
        info = sb.network.info()
        assert info.address == "169.254.0.2" and info.gateway == "169.254.0.1"
        assert info.internet and info.deny_out == ["203.0.113.0/24"]
        assert info.exposed == [(18765, 8000)]
        assert info.device

        sb.network.set_policy(internet=False, allow_out=["198.51.100.0/24"])
        info = sb.network.info()
        assert not info.internet
        assert info.allow_out == ["198.51.100.0/24"] and info.deny_out == []
        with pytest.raises(cubesandbox.InvalidArgument):
            sb.network.set_policy(allow_out=["not-a-cidr"])

        sb.network.unexpose(18765)
        sb.network.expose(18766, 8000)
        assert sb.network.info().exposed == [(18766, 8000)]

        host = _host_address()
        if host is not None:
            sb.commands.run(
                "python3 -m http.server 8000 --directory /tmp", background=True
            )
            body = b""
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and b" 200 " not in body:
                try:
                    with socket.create_connection((host, 18766), timeout=2) as s:
                        s.sendall(b"GET / HTTP/1.0\r\n\r\n")
                        body = s.recv(100)
                except OSError:
                    time.sleep(0.2)
            assert b" 200 " in body, body
            assert sb.network.counters.rx_packets > 0
    finally:
        sb.kill()


def test_bad_network_arguments_are_refused() -> None:
    with pytest.raises(cubesandbox.InvalidArgument):
        _networked(allow_out=["10.0.0.1/8"])
    with pytest.raises(cubesandbox.InvalidArgument):
        _networked(expose=["0"])
