"""WorkerAddress / WorkerInfo: naming, parsing, navigation (no Ray)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollfleet.cluster import WorkerAddress, WorkerInfo
from rollfleet.errors import InvalidInput


def test_cluster_address_names_and_navigation() -> None:
    group = WorkerAddress("Trainer")
    rank = group.get_child_address(1)
    child = rank.get_child_address(0)
    assert rank.get_name() == "Trainer:1"
    assert child.get_name() == "Trainer:1:0"
    assert str(child) == "Trainer:1:0"
    assert child.rank == 0
    assert child.get_parent_rank() == 1
    assert rank.get_parent_rank() == -1
    assert child.get_parent_address() == rank
    assert child.group_name == "Trainer:1"
    assert rank.group_name == "Trainer"


def test_cluster_address_parse_round_trip() -> None:
    assert WorkerAddress.parse("Trainer:1:0") == WorkerAddress("Trainer", (1, 0))
    assert WorkerAddress.from_name("G") == WorkerAddress("G")


@given(
    st.text(alphabet=st.characters(blacklist_characters=":"), min_size=1),
    st.lists(st.integers(0, 10_000), max_size=5),
)
def test_cluster_address_parse_inverts_get_name(root: str, ranks: list[int]) -> None:
    address = WorkerAddress(root, tuple(ranks))
    assert WorkerAddress.parse(address.get_name()) == address


@pytest.mark.parametrize("bad", ["", "G:x", "G:-1", ":0"])
def test_cluster_address_rejects_malformed_names(bad: str) -> None:
    with pytest.raises(InvalidInput):
        WorkerAddress.parse(bad)


def test_cluster_address_root_has_no_rank_or_parent() -> None:
    with pytest.raises(InvalidInput, match="names a group"):
        _ = WorkerAddress("G").rank
    with pytest.raises(InvalidInput, match="no parent"):
        WorkerAddress("G").get_parent_address()


def test_cluster_worker_info_env_has_torch_distributed_variables() -> None:
    info = WorkerInfo(
        address=WorkerAddress("G", (3,)),
        rank=3,
        world_size=4,
        node_id="n",
        node_ip="10.0.0.2",
        local_rank=1,
        local_world_size=2,
        gpu_id=2,
        available_gpus=(2, 3),
        master_addr="10.0.0.1",
        master_port=29500,
    )
    env = info.env()
    assert env["MASTER_ADDR"] == "10.0.0.1"
    assert env["MASTER_PORT"] == "29500"
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) == ("3", "1", "4")
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert env["ROLLFLEET_WORKER_ADDRESS"] == "G:3"
    assert "CUDA_VISIBLE_DEVICES" not in WorkerInfo(WorkerAddress("G", (0,)), 0, 1, "n", "ip").env()
