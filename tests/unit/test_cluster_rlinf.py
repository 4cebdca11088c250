"""RLinf's spellings, checked without Ray: send/recv's group argument names (with the older ones
still accepted) and create_channel's (name, node_id, maxsize) order refusing what it cannot mean."""

from __future__ import annotations

import importlib.util

import pytest

from rollfleet.cluster.address import WorkerAddress
from rollfleet.cluster.worker import _peer
from rollfleet.errors import InvalidInput


def test_cluster_peer_takes_rlinf_group_name_or_the_older_spelling() -> None:
    assert _peer("send", "trainer", None, 2) == WorkerAddress("trainer", (2,))  # dst_group_name=
    assert _peer("recv", None, "trainer:1", 0) == WorkerAddress("trainer", (1, 0))  # src_group=
    with pytest.raises(InvalidInput, match="send needs a group"):
        _peer("send", "a", "b", 0)  # both spellings at once: ambiguous
    with pytest.raises(InvalidInput, match="recv needs a group"):
        _peer("recv", None, None, 0)
    with pytest.raises(InvalidInput, match="rank=None"):
        _peer("send", "a", None, None)


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="the channel module needs Ray")
def test_cluster_create_channel_refuses_a_node_it_cannot_read() -> None:
    from rollfleet.cluster.channel import create_channel

    with pytest.raises(InvalidInput, match="node_id must be a node index or a Ray node id"):
        create_channel("c", 1.5, 4)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="node_id must be"):
        create_channel("c", True)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="maxsize must be >= 0"):
        create_channel("c", None, -1)
