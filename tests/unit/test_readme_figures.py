"""Every figure README.md states is generated from bench/results/*.json or a documented run's
metrics (bench/_headline.py): a README that disagrees with its sources fails here. After a
benchmark or a run changes them, ``python -m bench._headline`` rewrites the README."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def headline_module():  # type: ignore[no-untyped-def]
    """bench/_headline.py, loaded from the checkout."""
    spec = importlib.util.spec_from_file_location("bench_headline", ROOT / "bench" / "_headline.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_readme_states_every_generated_figure_as_its_sources_give_it() -> None:
    headline = headline_module()
    stated = headline.stated((ROOT / "README.md").read_text())
    assert set(stated) == set(headline.BLOCKS), "README.md lost a generated block's markers"
    for name, make in headline.BLOCKS.items():
        assert stated[name] == make(), f"README.md's {name!r} block: run python -m bench._headline"


def test_readme_figures_detects_a_changed_figure() -> None:
    headline = headline_module()
    text = (ROOT / "README.md").read_text()
    block = headline.stated(text)["demo"]
    edited = re.sub(r"\d", lambda m: str((int(m.group()) + 1) % 10), block, count=1)
    assert edited != block  # a figure was edited by hand
    assert headline.stated(text.replace(block, edited))["demo"] != headline.demo()


def test_readme_stays_a_newcomers_page() -> None:
    assert len((ROOT / "README.md").read_bytes()) <= 12 * 1024  # the rest lives under docs/
