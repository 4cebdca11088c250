"""The command provider with real shell commands: endpoint, reset, failures replaced."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollfleet.errors import PoolError
from rollfleet.pool.pool import Pool, PoolPolicy
from rollfleet.pool.providers.command import CommandProvider, CommandSpec


def fleet(root: Path, **overrides: str) -> CommandSpec:
    """Commands managing directories under ``root`` as the 'machines'."""
    commands = {
        "start": f'd="{root}/$ROLLFLEET_INSTANCE_ID.$$"; mkdir -p "$d" && echo starting && echo "$d"',
        "reset": 'if [ -e "$ROLLFLEET_ENDPOINT/.fail-reset" ]; then exit 7; fi; rm -rf "$ROLLFLEET_ENDPOINT"/*',
        "check": 'test -d "$ROLLFLEET_ENDPOINT" && ! test -e "$ROLLFLEET_ENDPOINT/.fail-check"',
        "stop": 'rm -rf "$ROLLFLEET_ENDPOINT"',
    }
    return CommandSpec.model_validate({**commands, **overrides})


async def test_command_pool_endpoint_is_starts_last_line_and_reset_cleans(tmp_path: Path) -> None:
    async with Pool(CommandProvider(fleet(tmp_path)), 1, name="vms") as pool:
        async with pool.lease(timeout=10) as first:
            assert first.endpoint is not None and first.endpoint.startswith(f"{tmp_path}/vms-0.")
            (Path(first.endpoint) / "dirty").write_text("x")
        async with pool.lease(timeout=10) as second:
            assert (
                second.endpoint == first.endpoint and not (Path(first.endpoint) / "dirty").exists()
            )
    assert not Path(first.endpoint).exists()


@pytest.mark.parametrize("marker", [".fail-reset", ".fail-check"])
async def test_command_pool_replaces_an_instance_whose_reset_or_check_fails(
    tmp_path: Path, marker: str
) -> None:
    async with Pool(CommandProvider(fleet(tmp_path)), 1, name="vms") as pool:
        async with pool.lease(timeout=10) as first:
            (Path(first.endpoint) / marker).write_text("x")  # type: ignore[arg-type]
        stats = await pool.wait_for(lambda s: s.replacements == 1 and s.states["IDLE"] == 1, 10)
        assert "exited" in (stats.instances[0].last_error or "") or "check" in (
            stats.instances[0].last_error or ""
        )
        async with pool.lease(timeout=10) as second:
            assert second.endpoint != first.endpoint and second.generation == 1
        assert not Path(first.endpoint).exists()  # type: ignore[arg-type]


async def test_command_failure_names_the_step_and_stderr(tmp_path: Path) -> None:
    provider = CommandProvider(CommandSpec(start="echo 'no capacity' >&2; exit 4"))
    with pytest.raises(PoolError, match=r"start command for x-0 exited 4: no capacity"):
        await provider.start("x-0")
    pool = Pool(provider, 1, name="x", policy=PoolPolicy(max_start_attempts=2, backoff_s=0.0))
    with pytest.raises(PoolError, match="no capacity"):
        await pool.acquire(10)
    await pool.close()


async def test_command_instance_id_is_passed_as_data_not_code(tmp_path: Path) -> None:
    out = tmp_path / "ids"
    provider = CommandProvider(
        CommandSpec(start=f'printf "%s" "$ROLLFLEET_INSTANCE_ID" > "{out}"; echo ok')
    )
    await provider.start("x; touch pwned")
    assert out.read_text() == "x; touch pwned" and not Path("pwned").exists()
