"""The distribution: one version source, the license, dependency bounds, python -m flashattn."""

import os
import re
import subprocess
import sys

import flashattn
from conftest import REPO


def _read(name):
    with open(os.path.join(REPO, name)) as f:
        return f.read()


def test_version_single_source():
    cmake = re.search(r"project\(flashattn VERSION ([0-9.]+)", _read("CMakeLists.txt")).group(1)
    assert flashattn.__version__ == cmake
    pyproject = _read("pyproject.toml")
    assert re.search(r"^version\s*=", pyproject, re.M) is None, "pyproject.toml must not state its own version"
    assert re.search(r'dynamic\s*=\s*\[\s*"version"\s*\]', pyproject)
    assert 'input = "CMakeLists.txt"' in pyproject


def test_license_and_bounds():
    assert _read("LICENSE").startswith("MIT License")
    pyproject = _read("pyproject.toml")
    assert re.search(r'^license\s*=\s*\{\s*text\s*=\s*"MIT"\s*\}', pyproject, re.M)
    assert "SPDX-License-Identifier: MIT" in _read("CMakeLists.txt")
    deps = re.search(r"^dependencies\s*=\s*\[(.*)\]", pyproject, re.M).group(1)
    for name in ("numpy", "ml_dtypes"):
        assert re.search(rf'"{name}>=[0-9]', deps), f"{name} has no lower bound: {deps}"


def _module(*args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    res = subprocess.run([sys.executable, "-m", "flashattn", *args], capture_output=True, text=True, env=env,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


def test_python_m_flashattn():
    assert _module("--version").strip() == flashattn.__version__
    report = _module()
    assert report.splitlines()[0] == f"flashattn {flashattn.__version__}"
    assert f"SIMD target: {flashattn.simd_target()}" in report
    assert re.search(r"^forward kernels: tiled, decode", report, re.M)
    assert re.search(r"^threads \(NumPy calls\): [1-9][0-9]*$", report, re.M)
