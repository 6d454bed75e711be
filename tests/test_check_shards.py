"""`python -m sparseforge.check --shard I/N` (the sanitizer test's processes side by side)."""

import argparse

import pytest
from sparseforge.check import shard_spec


def test_shards_cover_every_variant_once():
    variants = [f"v{i}" for i in range(11)]
    shards = [variants[i::n] for i, n in (shard_spec(f"{i}/4") for i in range(4))]
    assert sorted(sum(shards, [])) == sorted(variants)
    assert shard_spec("0/1") == (0, 1)


@pytest.mark.parametrize("text", ["4/4", "-1/4", "1", "a/b", "1/0", "1/2/3"])
def test_bad_shards_are_refused(text):
    with pytest.raises(argparse.ArgumentTypeError, match="--shard"):
        shard_spec(text)
