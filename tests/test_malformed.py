"""Hostile and damaged tiles: every reader check of FORMAT.md raises FormatError, by name.

Each test changes one thing and fixes the CRC, so it is the named check, not the CRC, that has
to catch it: removing that check makes the test fail.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
import zstandard
from tilekit import (
    exception_frame,
    patch,
    patch_indptr,
    planes,
    read_header,
    read_table,
    reference_tile,
    replace_frame,
    with_crc,
    zframe,
)

import deltacells as dc
from deltacells import FormatError
from deltacells.codec.scatter import gather_tiles_into_many
from deltacells.codec.tile import gather_tiles_into
from deltacells.testing import check_rejects_or_decodes, fuzz_tiles

DATA = Path(__file__).resolve().parent / "data"
N_GENES = 140_000


def exception_matrix() -> sp.csr_matrix:
    """Six cells; chunk 0 (cells 0-2) has value and gap exceptions, chunk 1 has some too."""
    dense_rows = {
        0: {0: 70_000, 70_000: 5},  # a count and a gap above 65535
        1: {3: 1, 100_000: 65_535, 139_999: 100_000},  # two large gaps, one large count
        2: {},
        3: {1: 2, 2: 3, 80_000: 4},
        4: {139_998: 1},
        5: {5: 65_536},
    }
    rows, cols, vals = [], [], []
    for r, entries in dense_rows.items():
        for c, v in entries.items():
            rows.append(r)
            cols.append(c)
            vals.append(v)
    return sp.csr_matrix((vals, (rows, cols)), shape=(6, N_GENES), dtype=np.int64)


@pytest.fixture(scope="module")
def blob() -> bytes:
    tile = dc.encode_tile(exception_matrix(), n_chunks=2)
    assert read_header(tile)["n_chunks"] == 2
    return tile


def rejects(blob: bytes, match: str, **kwargs) -> None:
    """The tile is refused at open or decode, with a message naming the rule."""
    with pytest.raises(FormatError, match=match):
        tile = dc.Tile(blob, **kwargs)
        tile.decode(np.int32)
        tile.gather(np.arange(tile.shape[0]))


def chunk_n(blob: bytes, chunk: int) -> int:
    table = read_table(blob)
    return int(table[chunk, 3] - table[chunk, 2])


def test_base_tile_is_valid(blob):
    tile = dc.Tile(blob)
    assert (tile.decode(np.int32) != exception_matrix()).nnz == 0
    assert tile.exception_counts.sum() >= 5
    assert check_rejects_or_decodes(blob) == "decoded"


# --- truncation and CRC -----------------------------------------------------------------------


@pytest.mark.parametrize("verify_crc", [True, False])
def test_every_truncation_is_rejected(blob, verify_crc):
    for length in range(len(blob)):
        with pytest.raises(FormatError):
            dc.Tile(blob[:length], verify_crc=verify_crc)


def test_every_truncation_of_a_v1_tile_is_rejected():
    blob = (DATA / "golden_v1.dct").read_bytes()
    for length in range(0, len(blob), 7):
        with pytest.raises(FormatError):
            dc.Tile(blob[:length])


def test_any_flipped_byte_fails_the_crc(blob):
    for pos in range(64, len(blob)):
        damaged = bytearray(blob)
        damaged[pos] ^= 0x40
        with pytest.raises(FormatError, match="CRC-32 mismatch"):
            dc.Tile(bytes(damaged))


def test_flipped_bytes_without_crc_never_crash_or_mislead(blob):
    # Past the CRC, a flip is rejected by a structural check or decodes to a well-formed matrix
    # (a flipped literal byte inside a frame can be a different valid count: that is what the
    # CRC is for).
    outcomes = {"rejected": 0, "decoded": 0}
    for pos in range(len(blob)):
        damaged = bytearray(blob)
        damaged[pos] ^= 0x5A
        outcomes[check_rejects_or_decodes(with_crc(damaged), verify_crc=False)] += 1
    assert outcomes["rejected"] > len(blob) // 4


@pytest.mark.parametrize("size", [64, 65, 1000, (1 << 20) + 3, (3 << 20) + 17])
@pytest.mark.parametrize("n_threads", [1, 2, 3])
def test_crc32_range_equals_zlib(size, n_threads):
    # Whichever library computes it (libdeflate or zlib, see crc_backend) and however the range
    # is split between threads, the CRC is zlib's.
    import zlib

    from deltacells.codec import _checksum

    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    assert _checksum.crc_backend() in ("libdeflate", "zlib")
    assert _checksum.crc32_range(data, 64, n_threads) == zlib.crc32(data[64:].tobytes())


def test_crc_switch(blob):
    damaged = bytearray(blob)
    struct.pack_into("<I", damaged, 56, 0xDEADBEEF)
    rejects(bytes(damaged), "CRC-32 mismatch")
    assert (
        dc.Tile(bytes(damaged), verify_crc=False).decode(np.int32) != exception_matrix()
    ).nnz == 0


# --- header -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"magic": b"DELTACEX"}, "bad magic"),
        ({"version": 3}, "unsupported tile version 3 .this reader knows 1 and 2.: written by "
                         "a newer deltacells, or the header is damaged"),
        ({"version": 0}, "unsupported tile version 0"),
        ({"flags": 1}, "unknown flags"),
        ({"reserved": 7}, "reserved header field"),
        ({"total_size": 10**6}, "total_size"),
        ({"n_genes": 0}, "n_genes 0 outside"),
        ({"n_genes": 2**31 + 1}, "n_genes .* outside"),
        ({"n_chunks": 10**6}, "chunk table of 1000000 entries runs past the end"),
        ({"indptr_off": 64 + 96 * 2 + 4}, "indptr_off .* unaligned"),
        ({"indptr_off": 64}, "inside the chunk table"),
        ({"n_cells": 10**9}, "indptr of 1000000000 cells runs past the end"),
        ({"n_cells": 0}, "chunks iff it has cells"),
        ({"nnz": 10**12}, "header nnz"),
    ],
)
def test_bad_header_fields(blob, fields, match):
    rejects(patch(blob, **fields), match)


def test_v1_allows_at_most_65536_genes():
    blob = (DATA / "golden_v1.dct").read_bytes()
    assert dc.Tile(patch(blob, n_genes=65536)).shape[1] == 65536
    rejects(patch(blob, n_genes=65537), "n_genes 65537 outside 1..65536 for version 1")


def test_short_blob_and_wrong_object_size(blob):
    rejects(b"DELTACEL", "shorter than the 64-byte header")
    rejects(blob + bytes(8), "total_size .* != object size")


# --- indptr -----------------------------------------------------------------------------------


def test_indptr_must_start_at_zero(blob):
    rejects(patch_indptr(blob, 0, 1), r"indptr\[0\] is 1")


def test_indptr_must_not_decrease(blob):
    rejects(patch_indptr(blob, 1, 10**6), "must be non-decreasing")


def test_cell_cannot_hold_more_than_n_genes(blob):
    rejects(patch(blob, n_genes=2), "has 3 nonzeros .*n_genes=2")


# --- chunk table ------------------------------------------------------------------------------


def table_patch(blob, chunk, column, value):
    table = read_table(blob)
    table[chunk, column] = value
    return patch(blob, table=table)


def test_chunks_must_be_contiguous(blob):
    table = read_table(blob)
    rejects(table_patch(blob, 1, 0, table[1, 0] + 1), "cover the tile contiguously")
    rejects(table_patch(blob, 1, 2, table[1, 2] - 1), "cover the tile contiguously")
    rejects(table_patch(blob, 0, 0, 1), "cover the tile contiguously")


def test_chunk_nnz_must_agree_with_indptr(blob):
    table = read_table(blob)
    table[0, 3] += 1
    table[1, 2] += 1
    rejects(patch(blob, table=table), "disagrees with indptr")


def test_last_chunk_must_end_at_the_tile_end(blob):
    table = read_table(blob)
    table[1, 1] -= 1
    table[1, 3] = struct.unpack_from("<q", blob, read_header(blob)["indptr_off"] + 8 * 5)[0]
    rejects(patch(blob, table=table), "last chunk ends")


def test_chunk_cells_out_of_order(blob):
    table = read_table(blob)
    table[0, 1] = 2**63
    rejects(patch(blob, table=table), "out of order or range")


@pytest.mark.parametrize(("column", "delta", "match"), [
    (4, 4, "gaps frame offset .* not 8-byte aligned"),
    (6, 10**6, "vals frame .* outside the stream area"),
    (5, 10**6, "gaps frame .* outside the stream area"),
    (8, 2**64 - 2**20, "vexc frame .* outside the stream area"),
])  # fmt: skip
def test_frame_locations(blob, column, delta, match):
    table = read_table(blob)
    table[0, column] = (int(table[0, column]) + delta) % 2**64
    rejects(patch(blob, table=table), match)


def test_frame_inside_indptr_is_rejected(blob):
    rejects(table_patch(blob, 0, 4, read_header(blob)["indptr_off"]), "outside the stream area")


def test_gaps_frame_cannot_be_absent(blob):
    rejects(table_patch(blob, 0, 5, 0), "gaps frame has length 0")


def test_chunk_of_2_to_the_32_nonzeros_is_rejected():
    # Three huge cells in one chunk: the header is consistent, the chunk is too large.
    small = dc.encode_tile(sp.csr_matrix(np.ones((3, 2))), n_chunks=1)
    huge = patch(small, n_genes=2**31, nnz=3 * 2**31)
    for cell, value in enumerate([0, 2**31, 2**32, 3 * 2**31]):
        huge = patch_indptr(huge, cell, value)
    table = read_table(huge)
    table[0, 3] = 3 * 2**31
    rejects(patch(huge, table=table), "fewer than 2\\^32")


# --- frames -----------------------------------------------------------------------------------


def test_frame_content_size_that_lies(blob):
    n = chunk_n(blob, 0)
    rejects(replace_frame(blob, 0, 0, zframe(planes(np.ones(n + 1)))), "content size lies")
    rejects(replace_frame(blob, 0, 1, zframe(planes(np.ones(n - 1)))), "content size lies")


def test_frame_without_content_size(blob):
    n = chunk_n(blob, 0)
    frame = zframe(planes(np.ones(n)), content_size=False)
    rejects(replace_frame(blob, 0, 0, frame), "without content size")


def test_frame_that_does_not_fill_its_length(blob):
    n = chunk_n(blob, 1)
    frame = zframe(planes(np.ones(n)))
    rejects(replace_frame(blob, 1, 1, frame + bytes(5)), "does not fill its stored length")
    rejects(replace_frame(blob, 1, 1, frame[:-2]), "does not fill its stored length")


def test_frame_whose_blocks_do_not_match_its_content_size(blob):
    # A hand-made frame: 4-byte content size 2n, then one raw block of only 2n - 2 bytes.
    n = chunk_n(blob, 0)
    block = bytes(2 * n - 2)
    frame = (
        struct.pack("<IB", 0xFD2FB528, 0xA0)
        + struct.pack("<I", 2 * n)
        + (1 | (len(block) << 3)).to_bytes(3, "little")
        + block
    )
    rejects(replace_frame(blob, 0, 0, frame), "decompression failed or gave the wrong size")


def test_gibberish_frame(blob):
    rejects(replace_frame(blob, 0, 1, b"\x00" * 16), "frame header unreadable")


def test_frame_checks_of_many_chunks_report_the_first_bad_one():
    # Tiles of many chunks have their frames checked in parallel; whatever the thread count,
    # the lowest bad chunk is named.
    rng = np.random.default_rng(21)
    matrix = sp.random(400, 300, density=0.05, format="csr", random_state=rng)
    matrix.data = np.ceil(matrix.data * 9)
    many = dc.encode_tile(matrix, n_chunks=200, level=1)
    damaged = replace_frame(many, 150, 1, b"\x00" * 16)
    damaged = replace_frame(damaged, 170, 0, b"\x00" * 16)
    for n_threads in (1, 2, 3):
        with pytest.raises(FormatError, match=r"chunk 150: zstd frame header unreadable"):
            dc.Tile(damaged, n_threads=n_threads)
    assert dc.Tile(many, n_threads=2).n_chunks == 200


def _reference(rows: list[list[int]], n_genes: int, values: list[list[int]] | None = None) -> bytes:
    """A one-chunk tile built by the reference encoder from raw (possibly bad) rows."""
    indptr = np.cumsum([0] + [len(r) for r in rows])
    indices = np.array([g for r in rows for g in r], dtype=np.int64)
    data = np.array([v for r in (values or [[1] * len(r) for r in rows]) for v in r])
    matrix = sp.csr_matrix((data, indices, indptr), shape=(len(rows), max(n_genes, 10**6)))
    return patch(reference_tile(matrix, [0, len(rows)], 2), n_genes=n_genes)


def test_reference_builder_makes_valid_tiles():
    blob = _reference([[0, 5, 9], [], [2]], 10)
    assert dc.Tile(blob).decode(np.int32).toarray().tolist()[0] == [1, 0, 0, 0, 0, 1, 0, 0, 0, 1]


def test_zero_gap_inside_a_cell_is_rejected():
    rejects(_reference([[0, 5, 9], [3, 3]], 10), "zero gap inside cell 1")


@pytest.mark.parametrize("position", [1, 2, 15, 16, 17, 40, 77, 100, 150, 198, 199])
def test_zero_gap_deep_inside_a_long_cell_is_rejected(position):
    # Inside a long cell gaps are checked 16 at a time (the whole-chunk pass), at its ends
    # one by one: a duplicate anywhere must be found.
    long = list(range(200))
    long[position] = long[position - 1]
    tile = dc.Tile(_reference([[1, 2, 3], list(range(7)), long, [5]], 300))
    for decode in (lambda: tile.decode(np.int32), lambda: tile.gather([2])):
        with pytest.raises(FormatError, match="zero gap inside cell 2"):
            decode()


def test_a_gather_over_several_tiles_names_the_damaged_one():
    # One parallel section decodes the chunks of every touched tile: its error must still
    # name the tile (and chunk) that failed, not the first tile of the read.
    good = dc.Tile(_reference([[0, 5, 9], [2]], 10), name="tiles/tile_000000.dct")
    bad = dc.Tile(_reference([[1], [3, 3]], 10), name="tiles/tile_000001.dct")
    rows = np.array([0, 1, 1, 0], dtype=np.int64)  # cells within their tiles
    groups = [np.array([0, 3]), np.array([1, 2])]
    indptr = np.array([0, 3, 5, 7, 10], dtype=np.int64)  # output rows of 3, 2, 2, 3 genes
    indices = np.empty(indptr[-1], dtype=np.int32)
    values = np.empty(indptr[-1], dtype=np.float32)
    with pytest.raises(FormatError, match=r"tile_000001\.dct: chunk 0: zero gap inside cell 1"):
        gather_tiles_into([good, bad], groups, rows, indptr, indices, values, n_threads=2)


def test_a_gather_into_batches_names_the_damaged_tile_and_checks_its_places():
    # The loader's path (rows decoded one by one into L1, renumbered, sorted and streamed to
    # their batches) reports a damaged tile as the plain gather does, and refuses places that
    # would write outside an output or over another row.
    good = dc.Tile(_reference([[0, 5, 9], [2]], 10), name="tiles/tile_000000.dct")
    bad = dc.Tile(_reference([[1], [3, 3]], 10), name="tiles/tile_000001.dct")
    col_map = np.arange(10)[::-1].copy()
    rows = np.array([0, 1, 1, 0], dtype=np.int64)
    groups = [np.array([0, 3]), np.array([1, 2])]
    outputs = [(np.empty(5, dtype=np.int32), np.empty(5, dtype=np.float32)) for _ in range(2)]
    which = np.array([0, 1, 0, 1])
    offsets = np.array([0, 0, 3, 2])  # rows of 3, 2, 2, 3 genes
    with pytest.raises(FormatError, match=r"tile_000001\.dct: chunk 0: zero gap inside cell 1"):
        gather_tiles_into_many([good, bad], groups, rows, outputs, which, offsets, col_map,
                               n_threads=2)  # fmt: skip
    fine = dc.Tile(_reference([[1], [3, 4]], 10), name="tiles/tile_000001.dct")
    gather_tiles_into_many([good, fine], groups, rows, outputs, which, offsets, col_map)
    assert outputs[0][0].tolist() == [0, 4, 9, 5, 6] and outputs[1][0].tolist() == [5, 6, 0, 4, 9]
    for bad_which, bad_offsets, problem in (
        ([0, 1, 0, 2], offsets, "names an output that does not exist"),
        (which, [0, 0, 4, 2], "does not fit in its output"),
        (which, [-1, 0, 3, 2], "does not fit in its output"),
        (which, [0, 0, 2, 2], "overlap in one output"),
    ):
        with pytest.raises(ValueError, match=problem):
            gather_tiles_into_many([good, fine], groups, rows, outputs, np.array(bad_which),
                                   np.array(bad_offsets), col_map)  # fmt: skip
    with pytest.raises(ValueError, match="needs col_map"):
        gather_tiles_into_many([good, fine], groups, rows, outputs, which, offsets, None)
    with pytest.raises(ValueError, match="col_map must be a permutation"):
        gather_tiles_into_many([good, fine], groups, rows, outputs, which, offsets, col_map[1:])


def test_gene_index_past_n_genes_at_the_end_of_a_long_cell():
    tile = dc.Tile(_reference([[1, 2], list(range(100, 300)), [5]], 299))
    for decode in (lambda: tile.decode(np.int32), lambda: tile.gather([1])):
        with pytest.raises(FormatError, match="gene index >= n_genes in cell 1"):
            decode()


def test_first_gene_zero_is_not_a_zero_gap():
    assert dc.Tile(_reference([[0], [0, 1]], 2)).decode(np.int32).nnz == 3


def test_gene_index_at_or_beyond_n_genes():
    rejects(_reference([[0, 5, 9], [2, 10]], 10), "gene index >= n_genes in cell 1")


def _stream(blob, chunk, which):
    """The uint16 values of a chunk's gaps (0) or vals (1) stream."""
    table = read_table(blob)
    off, length = int(table[chunk, 4 + 2 * which]), int(table[chunk, 5 + 2 * which])
    raw = np.frombuffer(zstandard.ZstdDecompressor().decompress(blob[off : off + length]), np.uint8)
    n = len(raw) // 2
    return raw[:n].astype(np.int64) | (raw[n:].astype(np.int64) << 8)


def test_stored_zero_count_is_rejected(blob):
    vals = _stream(blob, 1, 1)
    assert vals[1] == 3
    vals[1] = 0
    rejects(replace_frame(blob, 1, 1, zframe(planes(vals))), "stored count of 0")


def test_decode_errors_name_the_lowest_bad_chunk_whatever_the_thread_count():
    # A whole tile decodes each chunk's gene indices and values as separate parallel jobs; the
    # error is the first in (chunk, gaps before values) order, for any thread count.
    rng = np.random.default_rng(22)
    matrix = sp.random(300, 200, density=0.1, format="csr", random_state=rng)
    matrix.data = np.ceil(matrix.data * 9)
    many = dc.encode_tile(matrix, n_chunks=12, level=1)
    vals = _stream(many, 5, 1)
    vals[0] = 0
    zero_count = replace_frame(many, 5, 1, zframe(planes(vals)))
    gaps = _stream(many, 8, 0)
    gaps[1] = 0  # the second nonzero of a cell: a zero gap
    both = replace_frame(zero_count, 8, 0, zframe(planes(gaps)))
    gaps5 = _stream(many, 5, 0)
    gaps5[-1] = 60000  # the last gene of chunk 5 past n_genes
    gaps_and_values = replace_frame(zero_count, 5, 0, zframe(planes(gaps5)))
    for n_threads in (1, 2, 3, 8):
        for bad, match in (
            (both, r"chunk 5: .*stored count of 0"),
            (gaps_and_values, r"chunk 5: .*gene index >= n_genes"),
        ):
            with pytest.raises(FormatError, match=match):
                dc.decode_tile(bad, verify_crc=False, n_threads=n_threads)
        with pytest.raises(FormatError, match=r"chunk 8: zero gap"):
            dc.decode_tile(
                replace_frame(many, 8, 0, zframe(planes(gaps))),
                verify_crc=False,
                n_threads=n_threads,
            )


# --- exceptions -------------------------------------------------------------------------------


def _exceptions(blob, chunk, which):
    """Positions and payloads of a chunk's exception frame (which: 2 vexc, 3 gexc)."""
    table = read_table(blob)
    off, length = int(table[chunk, 4 + 2 * which]), int(table[chunk, 5 + 2 * which])
    raw = np.frombuffer(zstandard.ZstdDecompressor().decompress(blob[off : off + length]), "<u4")
    return raw[: len(raw) // 2].copy(), raw[len(raw) // 2 :].copy()


def test_exception_frames_of_base_tile(blob):
    pos, pay = _exceptions(blob, 0, 2)
    assert list(pay) == [70_000, 100_000]
    pos, pay = _exceptions(blob, 0, 3)
    assert list(pos) == [1, 3] and list(pay) == [70_000 - 65535, 99_997 - 65535]


def test_exception_frame_size_not_multiple_of_8(blob):
    rejects(replace_frame(blob, 0, 2, zframe(bytes(7))), r"not 8\*k bytes")


def test_more_exceptions_than_nonzeros(blob):
    n = chunk_n(blob, 0)
    frame = exception_frame(np.arange(n + 1), np.full(n + 1, 70_000))
    rejects(replace_frame(blob, 0, 2, frame), r"not 8\*k bytes")


def test_exception_positions_must_increase(blob):
    pos, pay = _exceptions(blob, 0, 3)
    rejects(replace_frame(blob, 0, 3, exception_frame(pos[::-1], pay[::-1])), "strictly increasing")
    dup = np.array([pos[0], pos[0]])
    rejects(replace_frame(blob, 0, 3, exception_frame(dup, pay[:2])), "strictly increasing")


def test_exception_position_beyond_chunk(blob):
    n = chunk_n(blob, 0)
    pos, pay = _exceptions(blob, 0, 2)
    pos[-1] = n
    rejects(replace_frame(blob, 0, 2, exception_frame(pos, pay)), ">= chunk nonzeros")


@pytest.mark.parametrize("payload", [0, 65535, 2**31, 2**32 - 1])
def test_value_exception_payload_range(blob, payload):
    pos, pay = _exceptions(blob, 0, 2)
    pay[0] = payload
    rejects(replace_frame(blob, 0, 2, exception_frame(pos, pay)), "value exception payload")


@pytest.mark.parametrize("payload", [0, N_GENES, 2**32 - 1])
def test_gap_exception_payload_range(blob, payload):
    pos, pay = _exceptions(blob, 0, 3)
    pay[0] = payload
    rejects(replace_frame(blob, 0, 3, exception_frame(pos, pay)), "gap exception payload")


def test_exception_where_stored_value_is_not_65535(blob):
    pos, pay = _exceptions(blob, 0, 2)
    pos[0] = 1 if pos[0] != 1 else 2  # a nonzero whose stored count is small
    order = np.argsort(pos)
    rejects(replace_frame(blob, 0, 2, exception_frame(pos[order], pay[order])), "is not 65535")


def test_gap_exceptions_adding_up_past_n_genes(blob):
    pos, pay = _exceptions(blob, 0, 3)
    pay[:] = N_GENES - 1  # each in range, but the sums leave the gene range
    rejects(replace_frame(blob, 0, 3, exception_frame(pos, pay)), "gene index >= n_genes")


def test_present_exception_frame_holding_no_exceptions_is_valid():
    """k = 0: a frame whose content is empty decodes as no exceptions (docs/format.md)."""
    matrix = sp.csr_matrix(np.array([[0, 3, 1], [2, 0, 0]]))
    plain = dc.encode_tile(matrix, n_chunks=1)
    for which in (2, 3):
        with_empty = replace_frame(plain, 0, which, zframe(b""))
        assert read_table(with_empty)[0, 5 + 2 * which] > 0
        tile = dc.Tile(with_empty)
        assert tile.exception_counts.tolist() == [[0, 0]]
        assert (tile.decode(np.int32) != matrix).nnz == 0
        assert (tile.gather([1, 0]) != matrix[[1, 0]]).nnz == 0


def test_empty_exception_frame_that_holds_data_is_refused():
    """A frame whose header says 0 bytes but whose block holds some: refused whatever the
    libzstd version (decompressing into no room fails)."""
    matrix = sp.csr_matrix(np.array([[0, 3, 1], [2, 0, 0]]))
    plain = dc.encode_tile(matrix, n_chunks=1)
    frame = bytearray(zstandard.ZstdCompressor(level=3, write_content_size=True).compress(
        bytes(16)))  # fmt: skip
    descriptor = frame[4]
    assert descriptor & 0x20 and not descriptor >> 6  # single segment, 1-byte content size
    frame[5] = 0  # the content size now says 0
    rejects(replace_frame(plain, 0, 2, bytes(frame)), "decompress|exception")


def test_the_writer_never_writes_an_empty_exception_frame(real_counts):
    for matrix in real_counts.values():
        tile = dc.Tile(dc.encode_tile(matrix[:400], n_chunks=16))
        table = read_table(bytes(tile._buf))
        counts = tile.exception_counts
        for which, column in ((2, 0), (3, 1)):
            present = table[:, 5 + 2 * which] > 0
            assert np.array_equal(present, counts[:, column] > 0)


# --- fuzzing ----------------------------------------------------------------------------------


def test_seeded_mutation_fuzz(blob):
    seeds = [
        blob,
        (DATA / "golden_v1.dct").read_bytes(),
        (DATA / "golden_v2.dct").read_bytes(),
        dc.encode_tile(sp.csr_matrix((5, 3), dtype=np.int32)),  # all cells empty
        dc.encode_tile(sp.csr_matrix((0, 3), dtype=np.int32)),  # zero cells
    ]
    report = fuzz_tiles(seeds, 5000, seed=1234)
    assert report.total == 5000
    assert report.rejected > 2500  # most mutants are caught; none crashed the process
