"""Helpers for testing deltacells and code built on it: mutation fuzzing of tiles, manifests
and obs shards.

:func:`fuzz_tiles` feeds mutated tiles to the decoder and checks the one promise a reader makes
about hostile input: it either raises :class:`~deltacells.FormatError` or returns a well-formed
matrix of the declared shape; it never crashes, hangs or allocates absurd memory.
:func:`fuzz_frame_contents` goes further for mutants whose zstd frames are valid but whose
content is damaged (the frames are decompressed, changed and compressed again, so no libzstd
version decides how a broken frame decodes): the decoder must agree exactly with
:func:`reference_decode`, a plain numpy reading of FORMAT.md. :func:`fuzz_manifests` and
:func:`fuzz_obs_shards` damage a dataset's manifest and obs shards (the shard's hash recorded
anew, so the parquet reader is reached) and read everything back. :func:`repeat_tiles` makes
a dataset of any size out of a small one, for measuring how reading scales to 100M cells.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import shutil
import struct
import tempfile
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import scipy.sparse as sp
import zstandard

from deltacells.codec.format import (
    CELL_HI,
    CELL_LO,
    HEADER_SIZE,
    NNZ_HI,
    NNZ_LO,
    FormatError,
    parse_layout,
)
from deltacells.codec.tile import Tile
from deltacells.store.integrity import sealed_json

__all__ = [
    "SPATIALDATA_SPEC",
    "FuzzReport",
    "ReferenceReject",
    "check_rejects_or_decodes",
    "fuzz_frame_contents",
    "fuzz_manifests",
    "fuzz_obs_shards",
    "fuzz_tiles",
    "mutate_frame_content",
    "mutate_tile",
    "reference_decode",
    "repeat_tiles",
    "reseal",
    "side_python",
]

_BOUNDARY_U64 = (0, 1, 7, 8, 63, 64, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1,
                 2**64 - 1)  # fmt: skip


def _fix_crc(blob: bytearray) -> None:
    if len(blob) >= HEADER_SIZE:
        struct.pack_into("<I", blob, 56, zlib.crc32(bytes(blob[HEADER_SIZE:])))


def mutate_tile(blob: bytes, rng: np.random.Generator) -> bytes:
    """Return a randomly damaged copy of a tile.

    Mutations: bit flips, random bytes, a 64-bit header or chunk-table field set to a boundary
    value, truncation, extension, and a copied byte range. Half of the mutants get a corrected
    CRC so that checks behind the CRC are exercised too.
    """
    out = bytearray(blob)
    kind = int(rng.integers(6))
    if kind == 0:
        for _ in range(int(rng.integers(1, 4))):
            pos = int(rng.integers(len(out)))
            out[pos] ^= 1 << int(rng.integers(8))
    elif kind == 1:
        pos = int(rng.integers(len(out)))
        n = int(rng.integers(1, 9))
        out[pos : pos + n] = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
    elif kind == 2:
        # A field of the header or chunk table, 8-byte aligned, set to a boundary value.
        table_end = min(len(out), HEADER_SIZE + 96 * 16)
        pos = 8 * int(rng.integers(table_end // 8))
        value = int(rng.choice(len(_BOUNDARY_U64)))
        value = _BOUNDARY_U64[value] if rng.random() < 0.7 else int(rng.integers(0, len(out) * 2))
        struct.pack_into("<Q", out, pos, value & (2**64 - 1))
    elif kind == 3:
        del out[int(rng.integers(len(out))) :]
    elif kind == 4:
        out += rng.integers(0, 256, int(rng.integers(1, 64)), dtype=np.uint8).tobytes()
    else:
        a, b = sorted(int(x) for x in rng.integers(0, len(out), 2))
        dest = int(rng.integers(len(out)))
        out[dest : dest + (b - a)] = out[a:b]
        del out[len(blob) :]
    if rng.random() < 0.5:
        _fix_crc(out)
    return bytes(out)


def check_rejects_or_decodes(blob: bytes, *, verify_crc: bool = True) -> str:
    """Decode ``blob`` fully and by gathering; return ``"rejected"`` or ``"decoded"``.

    Raises
    ------
    AssertionError
        If the decoder returns a malformed matrix (indices unsorted, out of range, or a shape
        other than the header's), or raises anything but :class:`.FormatError`.
    """
    try:
        tile = Tile(blob, verify_crc=verify_crc, n_threads=2)
        matrix = tile.decode(np.int32, n_threads=2)
        rows = np.arange(tile.shape[0])[::-1]
        gathered = tile.gather(rows, np.int32, n_threads=2)
    except FormatError:
        return "rejected"
    _assert_well_formed(matrix, tile.shape)
    _assert_well_formed(gathered, (len(rows), tile.shape[1]))
    assert (gathered != matrix[rows]).nnz == 0, "gather disagrees with decode"
    return "decoded"


def _assert_well_formed(matrix: sp.csr_matrix, shape: tuple[int, int]) -> None:
    assert matrix.shape == shape, f"shape {matrix.shape} != {shape}"
    indptr, indices, data = matrix.indptr, matrix.indices, matrix.data
    assert indptr[0] == 0 and np.all(np.diff(indptr) >= 0)
    if indices.size:
        assert indices.min() >= 0 and indices.max() < shape[1], "gene index out of range"
        assert data.min() >= 1, "a stored count below 1"
        within = np.diff(indices.astype(np.int64))
        starts = indptr[1:-1]
        mask = np.ones(within.size, dtype=bool)
        mask[starts[(starts > 0) & (starts <= within.size)] - 1] = False
        assert np.all(within[mask] > 0), "gene indices not strictly increasing within a cell"


@dataclass
class FuzzReport:
    """Counts of a fuzz run: how many mutants were rejected and how many decoded."""

    rejected: int = 0
    decoded: int = 0

    @property
    def total(self) -> int:
        """Mutants tried."""
        return self.rejected + self.decoded


def fuzz_tiles(seeds: Iterable[bytes], n_mutants: int, *, seed: int = 0) -> FuzzReport:
    """Run :func:`check_rejects_or_decodes` on ``n_mutants`` mutants of the seed tiles.

    Half of the mutants are checked without the CRC, so that damage the CRC would catch still
    reaches the structural and per-frame checks.
    """
    rng = np.random.default_rng(seed)
    corpus = list(seeds)
    report = FuzzReport()
    for i in range(n_mutants):
        mutant = mutate_tile(corpus[i % len(corpus)], rng)
        outcome = check_rejects_or_decodes(mutant, verify_crc=bool(i % 2))
        if outcome == "rejected":
            report.rejected += 1
        else:
            report.decoded += 1
    return report


# ---------------------------------------------------------------------------------------------
# Frame contents against a reference reading of FORMAT.md


class ReferenceReject(Exception):
    """:func:`reference_decode` found a rule of FORMAT.md broken."""


def _frame_of(blob: bytes, entry: np.ndarray, which: int) -> bytes | None:
    off, length = int(entry[4 + 2 * which]), int(entry[5 + 2 * which])
    if length == 0:
        return None
    return zstandard.ZstdDecompressor().decompress(blob[off : off + length])


def reference_decode(blob: bytes) -> sp.csr_matrix:
    """Decode a tile whose structure and frames are sound, value by value, with numpy.

    Independent of the kernels (only the structure parser is shared) and of how a libzstd
    version treats damaged frames (the ``zstandard`` package decompresses valid frames).

    Raises
    ------
    ReferenceReject
        For any content rule of FORMAT.md the tile breaks.
    """
    layout = parse_layout(blob)
    n_genes = layout.n_genes
    indptr = layout.indptr
    indices = np.zeros(layout.nnz, dtype=np.int64)
    values = np.zeros(layout.nnz, dtype=np.int64)
    for entry in layout.chunks:
        lo, hi = int(entry[NNZ_LO]), int(entry[NNZ_HI])
        n = hi - lo
        streams = []
        for which in (0, 1):
            raw = _frame_of(blob, entry, which)
            if raw is None or len(raw) != 2 * n:
                raise ReferenceReject("stream size")
            planes = np.frombuffer(raw, dtype=np.uint8).astype(np.int64)
            streams.append(planes[:n] | (planes[n:] << 8))
        gaps, vals = streams
        exceptions = []
        for which, (low, high) in ((2, (65536, 2**31 - 1)), (3, (1, n_genes - 1))):
            raw = _frame_of(blob, entry, which)
            raw = b"" if raw is None else raw
            if len(raw) % 8 or len(raw) // 8 > n:
                raise ReferenceReject("exception frame size")
            k = len(raw) // 8
            words = np.frombuffer(raw, dtype="<u4").astype(np.int64)
            pos, pay = words[:k], words[k:]
            if k and (np.any(np.diff(pos) <= 0) or pos[-1] >= n):
                raise ReferenceReject("exception positions")
            if np.any((pay < low) | (pay > high)):
                raise ReferenceReject("exception payload")
            exceptions.append((pos, pay))
        (vpos, vpay), (gpos, gpay) = exceptions
        if np.any(vals[vpos] != 65535) or np.any(gaps[gpos] != 65535):
            raise ReferenceReject("exception on a stored value other than 65535")
        vals = vals.copy()
        vals[vpos] = vpay
        extra = np.zeros(n, dtype=np.int64)
        extra[gpos] = gpay
        for cell in range(int(entry[CELL_LO]), int(entry[CELL_HI])):
            a, b = int(indptr[cell]) - lo, int(indptr[cell + 1]) - lo
            if np.any(gaps[a + 1 : b] == 0):
                raise ReferenceReject("zero gap inside a cell")
            genes = np.cumsum(gaps[a:b]) + np.cumsum(extra[a:b])
            if b > a and genes[-1] >= n_genes:
                raise ReferenceReject("gene index >= n_genes")
            indices[lo + a : lo + b] = genes
        if np.any(vals == 0):
            raise ReferenceReject("zero count")
        values[lo:hi] = vals
    return sp.csr_matrix((values, indices, indptr), shape=(layout.n_cells, n_genes))


def mutate_frame_content(blob: bytes, rng: np.random.Generator) -> bytes:
    """A copy of a sound tile with one frame's decompressed content changed and compressed
    again (valid zstd, content size included), so the decoder's value checks are reached.

    Content changes: one to three bytes set to random or boundary values (0, 1, 0xFF), one
    uint16 of a stream set to 0 or 65535, or the content lengthened or shortened by 2 or 8
    bytes. The frame is appended to the tile and the chunk table points at it; the CRC is
    corrected.
    """
    layout = parse_layout(blob)
    candidates = [(c, w) for c in range(layout.n_chunks) for w in range(4)
                  if layout.chunks[c, 5 + 2 * w] > 0]  # fmt: skip
    if not candidates:
        return blob
    chunk, which = candidates[int(rng.integers(len(candidates)))]
    content = bytearray(_frame_of(blob, layout.chunks[chunk], which) or b"")
    kind = int(rng.integers(4))
    if kind == 0 and content:
        for _ in range(int(rng.integers(1, 4))):
            pos = int(rng.integers(len(content)))
            content[pos] = int(rng.choice([0, 1, 0xFF, int(rng.integers(256))]))
    elif kind == 1 and len(content) >= 2:
        n = len(content) // 2
        i = int(rng.integers(n))
        value = int(rng.choice([0, 65535]))
        if which < 2:  # byte planes: low byte at i, high byte at n + i
            content[i], content[n + i] = value & 0xFF, value >> 8
        else:
            content[2 * i : 2 * i + 2] = struct.pack("<H", value)
    else:
        step = 2 if which < 2 else 8
        if rng.random() < 0.5:
            content += bytes(step)
        else:
            del content[max(0, len(content) - step) :]
    frame = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(bytes(content))
    out = bytearray(blob)
    out += bytes(-len(out) % 8)
    offset = len(out)
    out += frame
    table_at = HEADER_SIZE + 96 * chunk + 8 * (4 + 2 * which)
    struct.pack_into("<QQ", out, table_at, offset, len(frame))
    struct.pack_into("<Q", out, 48, len(out))  # total_size
    _fix_crc(out)
    return bytes(out)


def fuzz_frame_contents(seeds: Iterable[bytes], n_mutants: int, *, seed: int = 0) -> FuzzReport:
    """Mutants of :func:`mutate_frame_content`: the decoder must reject exactly those
    :func:`reference_decode` rejects, and decode the others to the reference's matrix, on one
    thread and on two, whole and by gathering."""
    rng = np.random.default_rng(seed)
    corpus = [s for s in seeds if parse_layout(s).version == 2]
    report = FuzzReport()
    for i in range(n_mutants):
        mutant = mutate_frame_content(corpus[i % len(corpus)], rng)
        try:
            expected = reference_decode(mutant)
        except ReferenceReject as why:
            expected, reason = None, str(why)
        try:
            tile = Tile(mutant)
            outcomes = [tile.decode(np.int32, n_threads=t) for t in (1, 2)]
            rows = np.arange(tile.shape[0])[::-1]
            outcomes.append(tile.gather(rows, np.int32, n_threads=2)[np.argsort(rows)])
        except FormatError as err:
            if expected is not None:
                raise AssertionError(
                    f"mutant {i}: rejected ({err}), the reference decodes it"
                ) from err
            report.rejected += 1
            continue
        if expected is None:
            raise AssertionError(f"mutant {i}: decoded, the reference rejects it ({reason})")
        for matrix in outcomes:
            _assert_well_formed(matrix, tile.shape)
            if (matrix != expected).nnz:
                raise AssertionError(f"mutant {i}: decoded to another matrix than the reference")
        report.decoded += 1
    return report


# ---------------------------------------------------------------------------------------------
# Dataset files

_POOL = (None, True, -1, 0, 1, 7, 63, 64, 2**31, 2**32, 2**62, 2**63, 2**64, 10**30, 1.5,
         float("1e308"), "", "x", [], [0], [2**40], {}, {"a": 1})  # fmt: skip


def _read_everything(root: Path, cache_dir: Path) -> None:
    """What a user does with a dataset: open, every tile, genes, obs, the lazy AnnData."""
    from deltacells.read.assemble import read_deltacells
    from deltacells.read.dataset import open_dataset

    dataset = open_dataset(root)
    for t in range(dataset.manifest.n_tiles):
        dataset.tile(t).decode(np.int32)
    dataset.gene_order()
    dataset.var_names()
    dataset.var()
    dataset.read_obs()
    adata = read_deltacells(root, cache_dir=cache_dir)
    adata.X.to_memory()
    dataset.verify()


def _read_back(report: FuzzReport, root: Path, cache_dir: Path, what: str, shown: str = ""):
    """Read everything of a damaged dataset: count a rejection (FormatError) or a clean read;
    anything else fails naming the mutant."""
    try:
        _read_everything(root, cache_dir)
        report.decoded += 1
    except FormatError:
        report.rejected += 1
    except Exception as err:
        raise AssertionError(f"{what} raised {err!r}" + (f":\n{shown}" if shown else "")) from err


def _mutate_json(obj, rng: np.random.Generator):
    """A copy of a JSON object with one value replaced, a key removed or a list changed."""
    out = json.loads(json.dumps(obj))
    node, target, key = out, None, None
    for _ in range(4):  # walk down a little: ``target[key]`` is what gets changed
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        if not keys:
            break
        target, key = node, keys[int(rng.integers(len(keys)))]
        if not isinstance(node[key], dict | list) or rng.random() < 0.4:
            break
        node = node[key]
    if key is None:
        return out
    action = int(rng.integers(4))
    if action == 0 and isinstance(target, dict):
        del target[key]
    elif action == 1 and isinstance(target[key], list):
        target[key] = target[key] + target[key][:1] if rng.random() < 0.5 else target[key][1:]
    elif action == 2 and isinstance(target[key], int) and not isinstance(target[key], bool):
        target[key] += int(rng.choice([-1, 1, 64, -64]))
    else:
        target[key] = _POOL[int(rng.integers(len(_POOL)))]
    return out


def fuzz_manifests(root: str | Path, n_mutants: int, *, seed: int = 0) -> FuzzReport:
    """Damage ``root``'s manifest ``n_mutants`` times (values, keys, lists, duplicate keys,
    truncation) and read everything back each time: only :class:`.FormatError` may come out.

    ``root`` is copied; the original is never changed.
    """
    rng = np.random.default_rng(seed)
    report = FuzzReport()
    with tempfile.TemporaryDirectory(prefix="deltacells-fuzz-") as tmp:
        work = Path(tmp) / "d"
        shutil.copytree(root, work)
        text = (work / "manifest.json").read_text()
        original = json.loads(text)
        for i in range(n_mutants):
            kind = int(rng.integers(10))
            if kind == 0:
                mutant = text[: int(rng.integers(len(text)))]
            elif kind == 1:
                key = list(original)[int(rng.integers(len(original)))]
                mutant = "{" + json.dumps(key) + ": 0, " + text.lstrip()[1:]
            else:
                changed = _mutate_json(original, rng)
                # Half sealed anew, as a deliberate edit would be: the checks behind the
                # digest must hold on their own.
                sealed = i % 2 and isinstance(changed, dict)
                mutant = sealed_json(changed) if sealed else json.dumps(changed)
            (work / "manifest.json").write_text(mutant)
            _read_back(report, work, Path(tmp) / f"cache{i % 4}", f"manifest mutant {i}",
                       mutant)  # fmt: skip
    return report


def fuzz_obs_shards(root: str | Path, n_mutants: int, *, seed: int = 0) -> FuzzReport:
    """Damage ``root``'s first obs shard ``n_mutants`` times (bit flips, random bytes,
    truncation, footer damage), record its size, hash and the obs fingerprint in the manifest
    as a writer would, and read everything back: only :class:`.FormatError` may come out (the
    parquet format has no checksums, so some damage reads back as other values)."""
    from deltacells.store.manifest import OBS_SCHEMA_NAME, obs_fingerprint, obs_shard_name

    rng = np.random.default_rng(seed)
    report = FuzzReport()
    with tempfile.TemporaryDirectory(prefix="deltacells-fuzz-") as tmp:
        work = Path(tmp) / "d"
        shutil.copytree(root, work)
        manifest = json.loads((work / "manifest.json").read_text())
        shard = work / obs_shard_name(0)
        pristine = shard.read_bytes()
        schema_text = (work / OBS_SCHEMA_NAME).read_text()
        for i in range(n_mutants):
            data = bytearray(pristine)
            kind = int(rng.integers(4))
            if kind == 0:
                for _ in range(int(rng.integers(1, 4))):
                    bit = int(rng.integers(8 * len(data)))
                    data[bit // 8] ^= 1 << (bit % 8)
            elif kind == 1:  # the footer, where the structure is
                pos = len(data) - 8 - int(rng.integers(min(len(data) - 8, 2000)))
                data[pos] = int(rng.integers(256))
            elif kind == 2:
                del data[int(rng.integers(len(data))) :]
            else:
                pos = int(rng.integers(len(data)))
                data[pos : pos + 4] = rng.integers(0, 256, 4, dtype=np.uint8).tobytes()
            shard.write_bytes(bytes(data))
            m = dict(manifest)
            m["obs_shard_bytes"] = [len(data), *manifest["obs_shard_bytes"][1:]]
            m["obs_shard_sha256"] = [hashlib.sha256(data).hexdigest(),
                                     *manifest["obs_shard_sha256"][1:]]  # fmt: skip
            m["obs_fingerprint"] = obs_fingerprint(schema_text, m["tile_cells"],
                                                   m["obs_shard_sha256"])  # fmt: skip
            (work / "manifest.json").write_text(sealed_json(m))
            _read_back(report, work, Path(tmp) / "cache", f"obs shard mutant {i} (kind {kind})")
    return report


def reseal(root: str | Path, manifest: dict | None = None) -> dict:
    """Record a deliberately edited local dataset anew in its manifest, as someone who rewrites
    the manifest would: the spatial grid checksums, the file table's sizes and hashes of the
    files now there (nested datasets first), and the manifest's digest. Tests use it to reach
    the checks that stand behind the digest and the file table (what a reader does with a
    well-sealed lie).

    Parameters
    ----------
    root
        The dataset directory.
    manifest
        The manifest object to write (default: the one there), e.g. with values changed.

    Returns
    -------
    dict
        The manifest object written.
    """
    from deltacells.store.integrity import FILES_KEY, file_record

    root = Path(root)
    path = root / "manifest.json"
    obj = json.loads(path.read_text()) if manifest is None else json.loads(json.dumps(manifest))
    from deltacells.spatial.grid import (
        GRID_SUMS_FILES,
        GRID_SUMS_NAME,
        TILE_OFFSETS_NAME,
        grid_checksums,
    )

    if (root / GRID_SUMS_NAME).is_file() and (root / TILE_OFFSETS_NAME).is_file():
        spatial = {n: (root / n).read_bytes() for n in GRID_SUMS_FILES if (root / n).is_file()}
        buffer = io.BytesIO()
        np.save(buffer, grid_checksums(spatial, np.load(root / TILE_OFFSETS_NAME)))
        (root / GRID_SUMS_NAME).write_bytes(buffer.getvalue())
    files = obj.get(FILES_KEY)
    if isinstance(files, dict):
        for name in list(files):
            if name.endswith("/manifest.json") and (root / name).is_file():
                reseal(root / name.rsplit("/", 1)[0])
        for name in list(files):
            target = root / name
            if target.is_file():
                files[name] = file_record(target.read_bytes())
            else:
                del files[name]
    text = sealed_json(obj)
    path.write_text(text)
    return json.loads(text)


#: What the spatialdata side environment holds (tests, ``bench_spatial``, ``tools/dev.sh``).
SPATIALDATA_SPEC = ("spatialdata==0.8.0",)


def side_python(venv: str | Path, packages: Iterable[str], explicit: str | None = None,
                minimum: tuple[int, int] = (3, 12)) -> str | None:  # fmt: skip
    """The Python of a virtualenv at ``venv`` holding ``packages``, made on first use from a
    Python of at least ``minimum`` (``explicit``, then ``python3.12`` / ``python3.13`` on
    PATH, then pyenv's versions). For tools that need a newer Python than the project's
    (spatialdata, annbatch). None when no such Python exists on this machine.

    Safe to call from several processes at once (the test command builds the spatialdata
    environment in the background while a suite runs): one builds under a lock file inside
    ``venv``, the others wait for it. An environment counts as made once its packages are
    installed (a stamp inside it records them), so an interrupted build is finished by the
    next call rather than used half-made.
    """
    import fcntl
    import os
    import subprocess

    venv, packages = Path(venv), list(packages)
    python = venv / "bin" / "python"
    stamp = venv / ".side-python-packages"
    wanted = "\n".join(packages)

    def made() -> bool:
        return stamp.exists() and stamp.read_text() == wanted

    if made():
        return str(python)
    check = f"import sys; sys.exit(sys.version_info < {tuple(minimum)!r})"

    def runs(executable: str | None) -> bool:
        # A pyenv shim is on PATH even when its version is not selected: ask each to run.
        if not executable or shutil.which(executable) is None:  # absent, or not a program
            return False
        return subprocess.run([executable, "-c", check], capture_output=True).returncode == 0

    # The lock lives inside the environment's folder (made first; ``venv`` fills it later),
    # so nothing is left beside it that version control would see.
    venv.mkdir(parents=True, exist_ok=True)
    with open(venv / ".side-python.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if made():  # made while this call waited
            return str(python)
        if not runs(str(python)):
            candidates = [explicit] if explicit else [shutil.which("python3.12"),
                                                      shutil.which("python3.13")]  # fmt: skip
            pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
            candidates += [str(p) for p in sorted(pyenv.glob("3.1[2-9]*/bin/python"))]
            base = next((c for c in candidates if runs(c)), None)
            if base is None:
                return None
            subprocess.run([base, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", *packages], check=True)
        stamp.write_text(wanted)
    return str(python)


def repeat_tiles(base: str | Path, target: str | Path, n_tiles: int, *,
                 drop_obs_names: bool = True) -> Path:  # fmt: skip
    """A large dataset made cheaply from a small one: tile ``i`` of ``target`` is a hard link
    to tile ``i % T`` of ``base`` (``T`` tiles), and so are its obs shards.

    The result is a valid dataset of ``n_tiles`` tiles that costs no disk space for its tiles;
    its manifest records the repeats under ``metadata["simulated"]``. Used to measure how
    opening, reading and loading grow from 100k to 100M cells.

    Parameters
    ----------
    base
        A local dataset whose tiles are all full and whose obs (if any) is one shard
        (written with ``obs_tiles_per_file`` at least its number of tiles).
    target
        A new local directory on the same file system.
    n_tiles
        Tiles of the result, a multiple of the base's tiles.
    drop_obs_names
        Store obs without its names column (repeated names would not be unique): readers then
        name cells ``"0" .. "n-1"``.

    Returns
    -------
    pathlib.Path
        ``target``.
    """
    import os

    import pyarrow.parquet as pq

    from deltacells.read.dataset import open_dataset
    from deltacells.store.manifest import (
        MANIFEST_NAME,
        OBS_SCHEMA_NAME,
        ObsSchema,
        obs_fingerprint,
        obs_shard_name,
        tile_name,
    )

    base, target = Path(base), Path(target)
    m = open_dataset(base).manifest
    n_base = m.n_tiles
    if n_base == 0 or n_tiles % n_base or any(c != m.tile_size for c in m.tile_cells):
        raise ValueError(f"{base}: needs full tiles only, and n_tiles a multiple of {n_base}")
    if m.has_obs and m.n_obs_shards != 1:
        raise ValueError(f"{base}: obs must be one shard (obs_tiles_per_file >= {n_base})")
    (target / "tiles").mkdir(parents=True)
    for i in range(n_tiles):
        os.link(base / tile_name(i % n_base), target / tile_name(i))
    for name in ("gene_order.npy", "var_names.txt", "var.parquet"):
        if (base / name).exists():
            os.link(base / name, target / name)
    repeats = n_tiles // n_base
    metadata = {k: v for k, v in m.metadata.items() if k not in ("anndata", "obs_pandas")}
    metadata["simulated"] = {"base": str(base), "base_tiles": n_base, "repeats": repeats}
    obs_fields: dict = {}
    if m.has_obs:
        (target / "obs").mkdir()
        schema_text = (base / OBS_SCHEMA_NAME).read_text()
        shard = base / obs_shard_name(0)
        index = m.metadata.get("obs_index_column")
        if drop_obs_names and index is not None:
            schema = ObsSchema.from_json_text(schema_text)
            schema_text = ObsSchema(tuple(c for c in schema.columns if c.name != index)) \
                .to_json_text()  # fmt: skip
            table = pq.read_table(shard).drop_columns([index])
            shard = target / "obs" / "base.parquet"
            pq.write_table(table, shard, row_group_size=m.tile_size)
            metadata |= {"obs_index_column": None, "obs_names_unique": None}
        (target / OBS_SCHEMA_NAME).write_text(schema_text)
        for s in range(repeats):
            os.link(shard, target / obs_shard_name(s))
        digest = hashlib.sha256(shard.read_bytes()).hexdigest()
        size = shard.stat().st_size
        if shard.parent == target / "obs":
            shard.unlink()  # the shards are links to it
        obs_fields = {
            "obs_tiles_per_file": n_base,
            "obs_shard_bytes": [size] * repeats,
            "obs_shard_sha256": [digest] * repeats,
            "obs_fingerprint": obs_fingerprint(
                schema_text, [m.tile_size] * n_tiles, [digest] * repeats
            ),
        }
    chunk_sums = None
    if m.chunk_sums is not None:  # the rows repeat with their tiles
        sums_name = m.chunk_sums["file"]
        (target / sums_name).write_bytes((base / sums_name).read_bytes() * repeats)
        chunk_sums = dict(m.chunk_sums, row_crc32=m.chunk_sums["row_crc32"] * repeats)
    files = None
    if m.files is not None:
        from deltacells.store.integrity import file_record

        files = {name: file_record((target / name).read_bytes())
                 for name in ("gene_order.npy", "var_names.txt", "var.parquet", OBS_SCHEMA_NAME)
                 if (target / name).exists()}  # fmt: skip
    manifest = dataclasses.replace(
        m, n_cells=m.tile_size * n_tiles, tile_cells=m.tile_cells * repeats,
        tile_nnz=m.tile_nnz * repeats, tile_bytes=m.tile_bytes * repeats,
        tile_crc32=None if m.tile_crc32 is None else m.tile_crc32 * repeats,
        metadata=metadata, files=files, chunk_sums=chunk_sums, **obs_fields,
    )  # fmt: skip
    (target / MANIFEST_NAME).write_text(manifest.to_json_text())
    return target
