"""The bounded fuzz run of every CI build: frame contents against the reference reading of
FORMAT.md, damaged manifests and damaged obs shards (tile-level mutation fuzzing is in
test_malformed.py). ``tools/fuzz.py`` runs the same targets for longer before a release."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp

import deltacells as dc
from deltacells.testing import (
    ReferenceReject,
    fuzz_frame_contents,
    fuzz_manifests,
    fuzz_obs_shards,
    reference_decode,
)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from fuzz import seed_dataset, seed_tiles


@pytest.fixture(scope="module")
def tiles():
    return seed_tiles()


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return seed_dataset(tmp_path_factory.mktemp("fuzz") / "d")


def test_reference_decoder_agrees_with_the_kernels_on_sound_tiles(tiles):
    for blob in tiles:
        if dc.Tile(blob).version == 2:
            assert (reference_decode(blob) != dc.decode_tile(blob, values_dtype=np.int32)).nnz == 0


def test_reference_decoder_rejects_what_the_format_forbids():
    blob = dc.encode_tile(sp.csr_matrix(np.array([[0, 3, 1], [2, 0, 0]])), n_chunks=1)
    from tilekit import planes, replace_frame, zframe

    with pytest.raises(ReferenceReject, match="zero gap"):
        reference_decode(replace_frame(blob, 0, 0, zframe(planes([1, 0, 0]))))
    with pytest.raises(ReferenceReject, match="zero count"):
        reference_decode(replace_frame(blob, 0, 1, zframe(planes([3, 0, 2]))))


def test_frame_content_fuzz(tiles):
    report = fuzz_frame_contents(tiles, 3000, seed=7)
    assert report.total == 3000
    assert report.rejected > 500 and report.decoded > 500  # both outcomes exercised


def test_manifest_fuzz(dataset):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = fuzz_manifests(dataset, 500, seed=7)
    assert report.total == 500 and report.rejected > 250
    dc.open_dataset(dataset).verify()  # the original was never changed


def test_obs_shard_fuzz(dataset):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = fuzz_obs_shards(dataset, 250, seed=7)
    assert report.total == 250 and report.rejected > 100
