"""`--cp-size`: parsed into the parallel config (world size tp x pp x cp), refused with one line where
it is not supported."""

import argparse

import pytest

from hicache.config import EngineConfig, ParallelConfig
from hicache.config.flags import add_engine_args
from hicache.engine.build import check_topology
from hicache.errors import UserError
from hicache.model.families.tiny import TINY_CONFIG


def test_cp_size_flag_sets_the_world_size():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    cfg = EngineConfig.from_args(parser.parse_args(["--cp-size", "2", "--tp-size", "2"]))
    assert (cfg.parallel.cp_size, cfg.parallel.world_size) == (2, 4)


def test_cp_with_pipeline_stages_is_a_topology_and_a_bad_cp_size_is_one_line():
    cfg = EngineConfig(parallel=ParallelConfig(cp_size=2, pp_size=2))
    check_topology(cfg, TINY_CONFIG)  # runs: tests/parallel/test_cp_tiers.py
    assert cfg.parallel.world_size == 4
    with pytest.raises(UserError, match="--cp-size must be >= 1"):
        ParallelConfig(cp_size=0)
