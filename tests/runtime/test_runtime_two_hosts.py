"""`rose train --address` on a two-host Ray cluster: two `ray start` nodes, each in its own network
namespace (a veth pair between them, each side with its own address and its own loopback) and its
own mount namespace (a private /tmp). Nodes on one machine share a loopback and a filesystem,
which hides a server bound to 127.0.0.1 or a checkpoint path only one host can see; here either
fails as it would across machines. Needs root (`ip netns`, `unshare`, `nsenter`)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

HEAD_IP, WORKER_IP, PORT = "10.77.0.1", "10.77.0.2", 6390
# Token authentication as a real cluster has it: every process presents ~/.ray/auth_token (one
# home here; across machines, copy the head's token to each node).
ENV = {**os.environ, "RAY_AUTH_MODE": "token"}
RAY = str(Path(sys.executable).with_name("ray"))


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def _private_tmp(netns: str, command: list[str]) -> list[str]:
    """`command` in network namespace `netns` and a new mount namespace with a private /tmp."""
    return ["ip", "netns", "exec", netns, "unshare", "--mount", "--propagation", "private", "sh", "-c",
            'mount -t tmpfs tmpfs /tmp && exec "$@"', "sh", *command]


def _ray_node(netns: str, ip: str, *args: str) -> subprocess.Popen:
    """A `ray start --block` node, its own session: killing its process group stops the node."""
    command = [RAY, "start", "--block", f"--node-ip-address={ip}", "--disable-usage-stats", *args]
    return subprocess.Popen(_private_tmp(netns, command), env=ENV, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


@pytest.fixture
def two_hosts() -> Iterator[dict[str, subprocess.Popen]]:
    """A head (the trainer's and rollout worker's resources) and a serving node, each a host of
    its own; yields the nodes' processes."""
    if os.geteuid() != 0 or not all(shutil.which(t) for t in ("ip", "unshare", "nsenter")):
        pytest.skip("needs root and ip, unshare, nsenter to give each Ray node a host of its own")
    tag = f"{os.getpid() % 100000}"
    names = {"head": f"rose-head-{tag}", "worker": f"rose-worker-{tag}"}
    veth = (f"rv1-{tag}", f"rv2-{tag}")
    try:
        for name in names.values():
            _ip("netns", "add", name)
    except subprocess.CalledProcessError as exc:
        for name in names.values():
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        pytest.skip(f"cannot create network namespaces here: {exc.stderr.decode().strip()}")
    nodes: dict[str, subprocess.Popen] = {}
    try:
        _ip("link", "add", veth[0], "type", "veth", "peer", "name", veth[1])
        hosts = ((names["head"], HEAD_IP), (names["worker"], WORKER_IP))
        for (name, ip), dev in zip(hosts, veth, strict=True):
            _ip("link", "set", dev, "netns", name)
            _ip("-n", name, "addr", "add", f"{ip}/24", "dev", dev)
            _ip("-n", name, "link", "set", dev, "up")
            _ip("-n", name, "link", "set", "lo", "up")
            _ip("-n", name, "route", "add", "default", "dev", dev)
        nodes["head"] = _ray_node(names["head"], HEAD_IP, "--head", f"--port={PORT}", "--num-cpus=2",
                                  '--resources={"trainer": 1, "rollout": 1}', "--include-dashboard=false")
        _wait_for_nodes(nodes["head"], 1)
        nodes["worker"] = _ray_node(names["worker"], WORKER_IP, f"--address={HEAD_IP}:{PORT}", "--num-cpus=1",
                                    '--resources={"serving": 1}')
        _wait_for_nodes(nodes["head"], 2)
        yield nodes
    finally:
        for node in nodes.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.pid, signal.SIGKILL)
            node.wait()
        for name in names.values():  # whatever a node left running in its namespace
            pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout
            for pid in pids.split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def _in_head(head: subprocess.Popen, command: list[str], timeout: float) -> subprocess.CompletedProcess:
    """`command` on the head's host: its network and its /tmp."""
    return subprocess.run(["nsenter", "-t", str(head.pid), "-n", "-m", *command], env=ENV,
                          capture_output=True, text=True, timeout=timeout)


def _wait_for_nodes(head: subprocess.Popen, count: int, timeout: float = 180.0) -> None:
    probe = ("import ray; ray.init(address='auto', logging_level='ERROR'); "
             "print(sum(n['Alive'] for n in ray.nodes()))")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert head.poll() is None, head.stderr.read().decode()[-3000:]
        try:  # a head still starting can keep a connecting driver waiting: ask again
            got = _in_head(head, [sys.executable, "-c", probe], 45)
        except subprocess.TimeoutExpired:
            continue
        if got.returncode == 0 and got.stdout.strip().splitlines()[-1:] == [str(count)]:
            return
        time.sleep(2)
    raise AssertionError(f"the cluster did not reach {count} nodes in {timeout:g} s")


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_rose_train_joins_a_two_host_cluster(two_hosts: dict[str, subprocess.Popen]) -> None:
    """The trainer and the rollout worker on the head's host, the serving executor on the other:
    turns leased across the link, weights shipped to it through the object store and the relay,
    checkpoints written on the trainer's host."""
    head = two_hosts["head"]
    run = _in_head(head, [
        sys.executable, "-m", "rose.cli", "train", "--address", f"{HEAD_IP}:{PORT}",
        "--json", "/tmp/run.json",
        "train.steps=2", "train.checkpoint_every=2", "rollout.groups=2", "rollout.group_size=2",
        "rollout.max_tokens=8", "rollout.dedicated_concurrency=1",  # the worker full: turns spill over
        "devices.resources.trainer.trainer=1", "devices.resources.dedicated.rollout=1",
        "devices.resources.serving.serving=1", "train.out_dir=/tmp/run"], timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    summary = json.loads(_in_head(head, ["cat", "/tmp/run.json"], 30).stdout)["summary"]
    assert summary["steps"] == 2 and summary["lost_trajectories"] == 0
    assert summary["serving_token_share"] > 0  # turns ran on the other host's executor
    assert _in_head(head, ["test", "-f", "/tmp/run/step-2/config.json"], 30).returncode == 0
    assert not Path("/tmp/run/step-2").exists()  # the checkpoint is the head host's alone
