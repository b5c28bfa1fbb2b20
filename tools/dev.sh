#!/usr/bin/env bash
# Set-up and the project's jobs in one place; every job first makes sure the environment exists.
#   bash tools/dev.sh demo   convert real data, read it back, slice it, print sizes and speeds
#   bash tools/dev.sh test   lint, the docs build (sphinx -n -W) and the test suite on both
#                            stacks: Python 3.11 + anndata 0.12, Python 3.12+ + anndata 0.13
#                            (what CI runs); test311 / test-newest run one stack
#   bash tools/dev.sh bench  the benchmarks (JSON + plots under benchmarks/results and docs/)
#   bash tools/dev.sh docs   build the Sphinx docs into docs/_build/html, warnings as errors
#   bash tools/dev.sh wheel  build a wheel and bundle libzstd/libdeflate/libgomp into wheelhouse/
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${DELTACELLS_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
export PATH="$VENV/bin:$PATH"  # tools such as cython-lint call pycodestyle by name
SYSTEM_PACKAGES="libzstd-dev zlib1g-dev pkg-config"
# Optional: libdeflate's CRC-32 is about 4x zlib's (tile checks); builds without it work alike.
OPTIONAL_PACKAGES="libdeflate-dev"

can_apt() { [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; }

ensure_system_libraries() {
  if ! { command -v pkg-config >/dev/null 2>&1 && pkg-config --exists libzstd zlib; }; then
    if can_apt; then
      echo "deltacells: installing $SYSTEM_PACKAGES $OPTIONAL_PACKAGES with apt-get" >&2
      apt-get update -qq
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $SYSTEM_PACKAGES >/dev/null
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $OPTIONAL_PACKAGES >/dev/null || true
    else
      echo "deltacells: building needs the libzstd and zlib headers and pkg-config." >&2
      echo "Install them, then run this again:  sudo apt-get install $SYSTEM_PACKAGES" >&2
      echo "(optional, faster CRC checks: sudo apt-get install $OPTIONAL_PACKAGES)" >&2
      exit 1
    fi
  fi
  if ! pkg-config --exists libdeflate; then
    if can_apt; then
      echo "deltacells: installing $OPTIONAL_PACKAGES (optional) with apt-get" >&2
      { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
          apt-get install -y -qq $OPTIONAL_PACKAGES >/dev/null; } || true
    else
      echo "deltacells: note: building without libdeflate (CRC checks use zlib, ~4x slower);" \
           "sudo apt-get install $OPTIONAL_PACKAGES to speed them up" >&2
    fi
  fi
}

# Make the virtualenv $1 with interpreter $2 and install the package into it with the pip
# arguments that follow, unless it already holds this build (the stamp: build files and
# libdeflate's presence, which change what gets compiled).
install_environment() {
  local venv="$1" python="$2"
  shift 2
  if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
  fi
  local stamp="$venv/.deltacells-installed"
  local wanted
  wanted="$({ cat pyproject.toml meson.build src/deltacells/meson.build
              pkg-config --modversion libdeflate 2>/dev/null || true; } | sha256sum | cut -d' ' -f1)"
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$wanted" ] \
     || ! "$venv/bin/python" -c "import deltacells" >/dev/null 2>&1; then
    "$venv/bin/python" -m pip install -q --upgrade pip
    # Build requirements first: the editable install uses this environment, not an isolated one.
    "$venv/bin/python" -m pip install -q "meson-python>=0.15" "meson>=1.1" ninja "cython>=3.0.8" numpy
    "$venv/bin/python" -m pip install -q --no-build-isolation "$@"
    echo "$wanted" > "$stamp"
  fi
}

ensure_environment() {
  ensure_system_libraries
  install_environment "$VENV" "$PYTHON" -e ".[dev]"
}

# The second stack users have: Python 3.12 (or 3.13) with the newest anndata, pandas, zarr and
# scanpy that pip resolves there (anndata 0.13 needs Python >= 3.12). torch is left out: its
# CPU build is on this machine for Python 3.11 only (elsewhere pip would fetch a CUDA build).
NEW_VENV="${DELTACELLS_NEW_VENV:-$ROOT/.venvs/newest}"

find_new_python() {
  local candidate
  for candidate in python3.12 python3.13 "$HOME"/.pyenv/versions/3.12*/bin/python3.12 \
                   "$HOME"/.pyenv/versions/3.13*/bin/python3.13; do
    if "$candidate" -c 'import sys; assert sys.version_info >= (3, 12)' >/dev/null 2>&1; then
      command -v "$candidate" 2>/dev/null || echo "$candidate"
      return 0
    fi
  done
  return 1
}

ensure_new_stack() {
  ensure_system_libraries
  local python
  if ! python="$(find_new_python)"; then
    echo "deltacells: the second test stack needs Python 3.12 or 3.13 (none found); install" \
         "one (e.g. pyenv install 3.12) or run only the first stack: bash tools/dev.sh test311" >&2
    exit 1
  fi
  install_environment "$NEW_VENV" "$python" --upgrade \
    -e ".[test,bench,docs,dask,scanpy,spatial,obstore,wheel]" scanpy anndata pandas zarr
}

stack_versions() {
  "$1" -c 'import sys, importlib.metadata as m; print("deltacells: testing on Python", sys.version.split()[0], *(f"{p} {m.version(p)}" for p in ("anndata", "pandas", "zarr", "numpy", "scipy")))'
}

# Debian ships the Python, scipy, pandas and fsspec docs' inventories: the docs' links to those
# projects are then checked on machines without the web (CI reaches only PyPI and Debian).
DOC_PACKAGES="python3-doc python-scipy-doc python-pandas-doc python-fsspec-doc"

build_docs() {
  if can_apt && ! dpkg -s $DOC_PACKAGES >/dev/null 2>&1; then
    echo "deltacells: installing $DOC_PACKAGES (inventories for the docs' links) with apt-get" >&2
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -qq $DOC_PACKAGES >/dev/null; } || true
  fi
  # Without the web, links into projects without a local inventory are listed, not checked.
  if ! "$VENV/bin/python" -c "import urllib.request as u; u.urlopen('https://docs.python.org/3/objects.inv', timeout=5)" >/dev/null 2>&1; then
    export DELTACELLS_DOCS_OFFLINE=1
  fi
  # -n: every cross-reference must resolve; -W: any warning fails the build.
  "$VENV/bin/python" -m sphinx -E -n -W --keep-going -q -b html docs docs/_build/html
}

job="${1:-}"
shift || true
case "$job" in
  demo)
    ensure_environment
    "$VENV/bin/python" tools/demo.py "$@"
    ;;
  test)
    # Both stacks users have: Python 3.11 with anndata 0.12, then Python 3.12+ with the
    # newest anndata, pandas, zarr and scanpy. Each suite runs whole even if the other failed.
    ensure_environment
    # The second stack and the spatialdata environment (the export tests' reader) are set up
    # in the background while the first stack runs: mostly downloads and one compile, which
    # the mostly single-threaded suite leaves room for on 2 cores. At a lower priority
    # (nice 10), so that they take the room the suite leaves rather than slowing it.
    setup_logs="$ROOT/build/setup-logs"
    mkdir -p "$setup_logs"
    ( renice -n 10 -p "$BASHPID" >/dev/null 2>&1 || true; ensure_new_stack
      # Not fatal: it only fills numba's caches (a cold scanpy chain takes ~50 s longer).
      "$NEW_VENV/bin/python" tools/warm_jit.py || true ) \
      >"$setup_logs/newest.log" 2>&1 &
    new_stack_pid=$!
    # The same for the first stack, on the core its suite leaves free before the chain test.
    nice -n 10 "$VENV/bin/python" tools/warm_jit.py >"$setup_logs/warm-jit.log" 2>&1 &
    warm_pid=$!
    nice -n 10 "$VENV/bin/python" -c 'from deltacells.testing import SPATIALDATA_SPEC, side_python; side_python(".venvs/spatialdata", SPATIALDATA_SPEC)' \
      >"$setup_logs/spatialdata.log" 2>&1 &
    spatialdata_pid=$!
    status=0
    "$VENV/bin/ruff" check src tests benchmarks tools docs || status=$?
    "$VENV/bin/cython-lint" src/deltacells/codec/*.pyx src/deltacells/codec/*.pxd || status=$?
    build_docs || status=$?
    stack_versions "$VENV/bin/python"
    "$VENV/bin/python" -m pytest "$@" || status=$?
    wait "$warm_pid" || true
    if ! wait "$spatialdata_pid"; then
      # Not fatal here: the export tests build it again (or skip without Python 3.12).
      echo "deltacells: the spatialdata environment was not made in the background:" >&2
      tail -n 20 "$setup_logs/spatialdata.log" >&2
    fi
    if ! wait "$new_stack_pid"; then
      echo "deltacells: setting up the second stack failed:" >&2
      cat "$setup_logs/newest.log" >&2
      exit 1
    fi
    stack_versions "$NEW_VENV/bin/python"
    DELTACELLS_SECOND_STACK=1 "$NEW_VENV/bin/python" -m pytest "$@" || status=$?
    exit $status
    ;;
  test311)
    ensure_environment
    stack_versions "$VENV/bin/python"
    "$VENV/bin/python" -m pytest "$@"
    ;;
  test-newest)
    ensure_new_stack
    stack_versions "$NEW_VENV/bin/python"
    "$NEW_VENV/bin/python" -m pytest "$@"
    ;;
  bench)
    ensure_environment
    for script in benchmarks/bench_*.py; do "$VENV/bin/python" "$script" "$@"; done
    "$VENV/bin/python" benchmarks/goals.py  # the goals beside the runs' figures and limits
    ;;
  docs)
    ensure_environment
    build_docs
    ;;
  wheel)
    # A wheel that installs without the system libraries: auditwheel copies libzstd,
    # libdeflate and libgomp into it (zlib is part of the manylinux baseline). The platform
    # tag follows this machine's glibc; build in a manylinux image for older systems.
    ensure_environment
    rm -rf "$ROOT/build/wheel" && mkdir -p "$ROOT/build/wheel" "$ROOT/wheelhouse"
    "$VENV/bin/python" -m pip wheel -q --no-build-isolation --no-deps -w "$ROOT/build/wheel" .
    "$VENV/bin/auditwheel" repair -w "$ROOT/wheelhouse" "$ROOT"/build/wheel/deltacells-*.whl
    ;;
  *)
    echo "usage: bash tools/dev.sh {demo|test|test311|test-newest|bench|docs|wheel} [args...]" >&2
    exit 2
    ;;
esac
