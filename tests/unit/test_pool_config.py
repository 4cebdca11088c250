"""Pools config parsing: good files build pools; bad ones name the file and the field."""

from __future__ import annotations

import pytest
from support import bubblewrap

from rollfleet.errors import InvalidInput
from rollfleet.pool.config import build_pool, parse_config
from rollfleet.pool.providers.command import CommandProvider
from rollfleet.pool.providers.sandbox import SandboxProvider

GOOD = """
[pools.py]
provider = "sandbox"
size = 3
lease_s = 30
[pools.py.options]
cpu_s = 5
memory_mb = 256
[pools.py.policy]
reset_timeout_s = 10
max_start_attempts = 5

[pools.fleet]
provider = "command"
size = 2
[pools.fleet.options]
start = "echo host-$ROLLFLEET_INSTANCE_ID"
reset = "true"
"""


def test_good_config_builds_pools_with_their_options_and_policy() -> None:
    bubblewrap()
    config = parse_config(GOOD, "pools.toml")
    assert list(config.pools) == ["py", "fleet"]
    py = build_pool("py", config.pools["py"])
    assert isinstance(py.provider, SandboxProvider) and py.provider.limits.cpu_s == 5
    assert py.policy.max_start_attempts == 5 and len(py.stats().instances) == 3
    assert config.pools["py"].lease_s == 30
    fleet = build_pool("fleet", config.pools["fleet"])
    assert isinstance(fleet.provider, CommandProvider) and fleet.provider.spec.reset == "true"


def test_json_config_is_accepted() -> None:
    config = parse_config(
        '{"pools": {"a": {"provider": "desktop", "size": 1, '
        '"options": {"provider_name": "docker", "headless": true}}}}',
        "p.json",
    )
    assert config.pools["a"].options["provider_name"] == "docker"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[pools.a]\nprovider = "sandbox"\nsize = 0\n', "p.toml: pools.a.size: "),
        ('[pools.a]\nprovider = "vm"\nsize = 1\n', "p.toml: pools.a.provider: "),
        (
            '[pools.a]\nprovider = "sandbox"\nsize = 1\ncolour = 2\n',
            "p.toml: pools.a.colour: Extra",
        ),
        (
            '[pools.a]\nprovider = "sandbox"\nsize = 1\n[pools.a.options]\ncpu_s = "x"\n',
            "p.toml: pools.a.options.cpu_s: ",
        ),
        (
            '[pools.a]\nprovider = "command"\nsize = 1\n',
            "p.toml: pools.a.options.start: Field required",
        ),
        (
            '[pools.a]\nprovider = "desktop"\nsize = 1\n[pools.a.options]\nprovider_name = "qemu"\n',
            "p.toml: pools.a.options.provider_name: ",
        ),
        (
            '[pools.a]\nprovider = "sandbox"\nsize = 1\n[pools.a.policy]\nbackoff_s = -1\n',
            "p.toml: pools.a.policy.backoff_s: ",
        ),
        ("", "p.toml: pools: Field required"),
        ("[pools.a\n", "p.toml: not valid TOML"),
    ],
)
def test_bad_config_names_file_and_field(text: str, message: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        parse_config(text, "p.toml")
    assert message in caught.value.message


def test_bad_json_names_the_line() -> None:
    with pytest.raises(InvalidInput, match=r"p.json: line 2: not valid JSON"):
        parse_config('{"pools":\n  nope}', "p.json")
