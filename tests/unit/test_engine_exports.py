"""The engines package's public surface."""

from __future__ import annotations

import rollfleet.engines as engines


def test_engine_exports_resolve() -> None:
    assert sorted(engines.__all__) == engines.__all__
    for name in engines.__all__:
        assert getattr(engines, name) is not None, name


def test_engine_exports_each_subpackage_exports_its_own_main_names() -> None:
    import rollfleet.engines.gateway as gateway
    import rollfleet.engines.hf as hf
    import rollfleet.engines.llamacpp as llamacpp
    import rollfleet.engines.served as served
    import rollfleet.engines.weights as weights

    assert llamacpp.LlamaCppEngine and hf.HFEngine and gateway.Gateway
    assert weights.push_weights and served.OpenAIEngine
    for package in (llamacpp, hf, served, gateway, weights):
        assert sorted(package.__all__) == package.__all__
        for name in package.__all__:
            assert getattr(package, name).__module__.startswith(package.__name__ + "."), name


def test_engine_exports_client_points_at_the_gateway_v1() -> None:
    from rollfleet.engines.gateway.client import gateway_v1_url

    assert gateway_v1_url("http://h:1") == "http://h:1/v1"
    assert gateway_v1_url("http://h:1/v1/") == "http://h:1/v1"
    assert gateway_v1_url("http://h:1/gateway") == "http://h:1/gateway/v1"


async def test_engine_exports_llm_client_tags_calls_and_never_times_out_reads() -> None:
    from rollfleet.engines.gateway.client import llm_client

    async with llm_client("http://h:1", "ro-9", "at-9", token="tk") as client:
        assert client.default_headers["X-Rollfleet-Rollout"] == "ro-9"
        assert client.default_headers["X-Rollfleet-Attempt"] == "at-9"
        assert client.api_key == "tk" and client.max_retries == 0
        assert client.timeout.read is None and str(client.base_url) == "http://h:1/v1/"
