"""The public surface of rollfleet.coordinator is what __all__ says, and each name resolves."""

from __future__ import annotations

import rollfleet.coordinator as coordinator


def test_public_names_are_exported() -> None:
    assert sorted(coordinator.__all__) == [
        "AbortHook",
        "AbortResult",
        "BatchCoordinator",
        "BatchInfo",
        "BatchLifecycleState",
        "BatchState",
        "CoordinatorClient",
        "Experience",
        "ExperienceStats",
        "FinalizeResult",
        "RolloutCoordinator",
        "StragglerPolicy",
        "get_actor",
        "group_advantages",
        "read_experiences",
    ]
    assert all(getattr(coordinator, name) is not None for name in coordinator.__all__)


def test_trinity_names_and_lifecycle_values() -> None:
    assert [s.value for s in coordinator.BatchLifecycleState] == [
        "pending",
        "running",
        "finalizing",
        "finalized",
        "aborted",
    ]
    assert [p.value for p in coordinator.StragglerPolicy] == ["cancel", "carry_over", "wait"]
    for method in (
        "prepare",
        "shutdown",
        "submit_batch",
        "finalize_train_batch",
        "finalize_eval_batch",
        "abort_batch",
        "process_experiences",
        "get_batch",
        "list_batches",
    ):
        assert callable(getattr(coordinator.RolloutCoordinator, method))
        if method not in ("prepare", "shutdown"):  # the HTTP client has the same calls
            assert callable(getattr(coordinator.CoordinatorClient, method))
    assert callable(coordinator.get_actor)  # the coordinator as a Ray actor


def test_the_coordinator_module_does_not_import_the_actor() -> None:
    import ast
    from pathlib import Path

    tree = ast.parse(Path(coordinator.__file__).with_name("coordinator.py").read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {
        a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names
    }
    assert "rollfleet.coordinator" in {m.rsplit(".", 1)[0] for m in imported if m}  # it was parsed
    assert not {
        m for m in imported if m and m.endswith(".actor")
    }  # actor.py imports coordinator.py
