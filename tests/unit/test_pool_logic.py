"""The warm pool's pure rules (pal/manager/pool.py, PAL_POOL in pal/config_env.py, the
doctor's reading of /metrics)."""

from __future__ import annotations

import pytest

from pal.config_env import parse_pool
from pal.manager.pool import budgeted_targets, pool_key
from pal.ops.doctor import _pool_figures
from pal.sizes import DEFAULT_POOL, split_pool_entry


def test_pal_pool_names_sizes_and_counts_and_can_be_off() -> None:
    assert parse_pool(None) == DEFAULT_POOL and parse_pool("") == DEFAULT_POOL
    assert parse_pool("0") == () and parse_pool("off") == ()
    assert parse_pool("256m-1c-2048d:3, 512m-1c-2048d") == (("256m-1c-2048d", 3), ("512m-1c-2048d", 1))
    assert parse_pool("256m-1c-2048d:0") == ()
    assert parse_pool("256m-1c-2048d:2,code-interpreter@512m-1c-2048d:1") == (
        ("256m-1c-2048d", 2),
        ("code-interpreter@512m-1c-2048d", 1),
    )
    assert parse_pool("default@256m-1c-2048d:2") == (("256m-1c-2048d", 2),)
    bad_ones = ("256m:2", "256m-1c-2048d:x", "256m-1c-2048d:-1", "256m-1c-2048d:65", "99999m-1c-2048d:1")
    for bad in (*bad_ones, "@256m-1c-2048d:1", "Code@256m-1c-2048d:1", "a b@256m-1c-2048d"):
        with pytest.raises(ValueError, match="PAL_POOL"):
            parse_pool(bad)


def test_the_memory_budget_bounds_the_pool_in_pal_pools_order() -> None:
    wanted = (("256m-1c-2048d", 2), ("512m-1c-2048d", 2))
    assert budgeted_targets(wanted, 1536) == {"256m-1c-2048d": 2, "512m-1c-2048d": 2}
    assert budgeted_targets(wanted, 1024) == {"256m-1c-2048d": 2, "512m-1c-2048d": 1}
    assert budgeted_targets(wanted, 300) == {"256m-1c-2048d": 1, "512m-1c-2048d": 0}
    assert budgeted_targets(wanted, 0) == {"256m-1c-2048d": 0, "512m-1c-2048d": 0}


def test_a_pool_entry_names_its_image_unless_it_is_the_default_one() -> None:
    assert pool_key("default", 256, 1, 2048) == "256m-1c-2048d"
    assert pool_key("code-interpreter", 256, 1, 2048) == "code-interpreter@256m-1c-2048d"
    assert split_pool_entry("code-interpreter@256m-1c-2048d") == ("code-interpreter", "256m-1c-2048d")
    assert split_pool_entry("256m-1c-2048d") == ("default", "256m-1c-2048d")
    wanted = (("code-interpreter@512m-1c-2048d", 1), ("256m-1c-2048d", 2))
    assert budgeted_targets(wanted, 768) == {"code-interpreter@512m-1c-2048d": 1, "256m-1c-2048d": 1}


def test_doctor_reads_the_pool_figures_summed_over_nodes() -> None:
    text = "\n".join(
        [
            "# HELP pal_pool_ready Warm pool VMs ready to claim",
            'pal_pool_ready{node="a"} 2.0',
            'pal_pool_ready{node="b"} 1.0',
            'pal_pool_rss_bytes{node="a"} 1.048576e+08',
            'pal_node_vms_live{node="a"} 3.0',
        ]
    )
    assert _pool_figures(text) == {"ready": 3.0, "rss_bytes": 104857600.0}
