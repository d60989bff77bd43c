"""expertd installed the way a user installs it: its wheel, built from this tree, in fresh
virtual environments that see nothing of this one (no system site-packages).

- The wheel holds the package and its data, no build or egg-info leftovers, and its
  metadata asks for the client's needs only (grpcio, protobuf, numpy); the server's
  packages sit behind `expertd[server]`.
- A client-only install has no ninja, safetensors, prometheus-client or triton, and
  `ExpertClient` calls real shards.
- Beside tritonclient[grpc], and beside kserve (each pins protobuf < 7, and each defines
  the `inference.*` messages in protobuf's default pool), one process calls the shards
  with the expertd client, expertd's own OIP stubs, and the other package's client.
- The installed wheel (not this checkout) runs part of the test suite.

torch is not reinstalled into each environment: the client uses the torch it finds, so a
folder of links to this environment's torch and the packages torch needs (none of them
protobuf or gRPC) goes on the new environment's path. Everything else comes from the
package index, through pip's cache; without the index these tests skip and say so, unless
EXPERTD_REQUIRE_INSTALL_TESTS=1 (set by CI, .ci/run) makes that a failure.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import NoReturn

import numpy as np
import pytest
import torch
from conftest import hidden, routing

from expertd.kernels.reference import reference_forward, relative_error

ROOT = Path(__file__).resolve().parents[2]
FRONTEND = Path(__file__).with_name("install_frontend.py")
TOLERANCE = 1e-2  # docs/protocol.md: relative Frobenius error
PIP_TIMEOUT_S = 1200  # a bound for a cold pip cache on a busy machine, not a speed check
# What pip prints when it cannot reach the package index (a conflict reads differently:
# "ResolutionImpossible", "conflicting dependencies").
UNREACHABLE = re.compile(
    r"NewConnectionError|Failed to establish a new connection|Temporary failure in name"
    r"|Max retries exceeded|Network is unreachable"
)
LEFTOVERS = ("build/", ".egg-info", "__pycache__", ".pyc", "tests/", ".venv")
# Set (to anything but 0) where these tests must run: an unreachable index then fails them
# instead of skipping them, so such a run cannot pass without them.
REQUIRE = "EXPERTD_REQUIRE_INSTALL_TESTS"


def index_unreachable(what: str) -> NoReturn:
    """The package index is out of reach for `what`: skip, or fail when REQUIRE is set."""
    message = f"package index unreachable: {what}"
    if os.environ.get(REQUIRE, "").strip() not in ("", "0"):
        pytest.fail(f"{message} ({REQUIRE} is set: these tests must run here)", pytrace=False)
    pytest.skip(message)


def run(cmd: list[str], timeout: float = PIP_TIMEOUT_S, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kw
    )


def pip_install(python: Path, *args: str) -> None:
    done = run([python, "-m", "pip", "install", "--disable-pip-version-check", *args])
    if done.returncode != 0:
        output = done.stdout + done.stderr
        if UNREACHABLE.search(output) and "ResolutionImpossible" not in output:
            index_unreachable(f"pip install {' '.join(args)}")
        pytest.fail(f"pip install {' '.join(args)} failed:\n{output[-4000:]}")


UNREACHABLE_PIP = (
    "WARNING: Retrying (Retry(total=4, connect=None, read=None, redirect=None, status=None)) "
    "after connection broken by 'NewConnectionError(... Failed to establish a new connection: "
    "[Errno -3] Temporary failure in name resolution)': /simple/grpcio/\n"
    "ERROR: Could not find a version that satisfies the requirement grpcio\n"
)


@pytest.mark.parametrize("required", ["", "0", "1"])
def test_an_unreachable_index_skips_unless_these_tests_are_required(required, monkeypatch):
    """pip's output for an index out of reach (simulated: no pip runs) skips the test, or
    fails it when EXPERTD_REQUIRE_INSTALL_TESTS is set, as CI sets it; a conflict fails
    either way."""
    monkeypatch.setenv(REQUIRE, required)
    failed = subprocess.CompletedProcess([], 1, stdout="", stderr=UNREACHABLE_PIP)
    monkeypatch.setattr(sys.modules[__name__], "run", lambda *a, **k: failed)

    def outcome() -> Exception:
        try:
            pip_install(Path("python"), "grpcio")
        except (pytest.skip.Exception, pytest.fail.Exception) as e:
            return e
        raise AssertionError("pip_install went on after pip failed")

    got = outcome()
    wanted = pytest.fail.Exception if required == "1" else pytest.skip.Exception
    assert type(got) is wanted, f"{type(got).__name__}: {got}"
    assert "package index unreachable: pip install grpcio" in str(got)
    failed.stderr += "ERROR: ResolutionImpossible\n"
    got = outcome()
    assert type(got) is pytest.fail.Exception and "pip install grpcio failed" in str(got)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel of this tree, built by pip (isolated build) from a copy of the tree,
    so the checkout gets no build/ or egg-info of its own."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(
        ROOT,
        src,
        ignore=shutil.ignore_patterns(
            ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache"
        ),
    )
    out = tmp / "dist"
    done = run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", out, src])
    if done.returncode != 0:
        output = done.stdout + done.stderr
        if UNREACHABLE.search(output):
            index_unreachable("cannot fetch the build backend")
        pytest.fail(f"building the wheel failed:\n{output[-4000:]}")
    (found,) = out.glob("expertd-*.whl")
    return found


def torch_closure() -> set[str]:
    """The distributions the installed torch needs at run time (torch included)."""
    from packaging.requirements import Requirement

    seen: set[str] = set()
    todo = ["torch"]
    while todo:
        name = todo.pop()
        key = name.lower().replace("_", "-")
        if key in seen:
            continue
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # optional for this platform and not installed
        seen.add(key)
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


@pytest.fixture(scope="module")
def torch_links(tmp_path_factory) -> Path:
    """A folder of links to this environment's torch and what it needs."""
    links = tmp_path_factory.mktemp("torch-links")
    for name in torch_closure():
        dist = importlib.metadata.distribution(name)
        tops = {Path(f).parts[0] for f in dist.files or []}
        for top in sorted(tops - {"..", "bin"}):
            target = Path(dist.locate_file(top))
            if target.exists() and not (links / top).exists():
                (links / top).symlink_to(target)
    assert not (links / "google").exists() and not (links / "grpc").exists()
    return links


def make_venv(path: Path, torch_links: Path) -> Path:
    """A fresh virtual environment (no system site-packages) that sees torch_links."""
    done = run([sys.executable, "-m", "venv", path], timeout=300)
    assert done.returncode == 0, done.stderr
    python = path / "bin" / "python"
    purelib = run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], timeout=60
    ).stdout.strip()
    Path(purelib, "expertd-test-torch.pth").write_text(f"{torch_links}\n")
    return python


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> tuple[Path, dict]:
    """One layer-1 call: routed over all shards, and the same tokens with the experts
    outside shard 0 (0-7) dropped, for the single-shard OIP calls."""
    gen = torch.Generator().manual_seed(11)
    x = hidden(6, gen)
    ids, w = routing(6, gen)
    ids0 = ids.clone()
    ids0[ids0 >= 8] = -1
    data = {"x": x, "ids": ids, "ids0": ids0, "w": w, "layer": 1}
    path = tmp_path_factory.mktemp("cases") / "cases.npz"
    np.savez(
        path,
        x=x.float().numpy(),
        ids=ids.numpy(),
        ids0=ids0.numpy(),
        w=w.numpy(),
        layer=np.array(1),
    )
    return path, data


def frontend(python: Path, mode: str, addresses, cases, tmp_path: Path):
    path, _ = cases
    out, report = tmp_path / "out.npz", tmp_path / "report.json"
    # Run from an empty folder so the checkout's own `expertd/` is not on the path.
    done = run(
        [python, FRONTEND, mode, ",".join(addresses), path, out, report],
        timeout=600,
        cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return dict(np.load(out)), json.loads(report.read_text())


def check_outputs(outputs, cases, full_layers, venv: Path) -> None:
    _, c = cases
    layer = full_layers[c["layer"]]
    expected = {
        "client": reference_forward(layer, c["x"], c["ids"], c["w"]),
        "ours": reference_forward(layer, c["x"], c["ids0"], c["w"]),
    }
    expected["other"] = expected["ours"]
    for name, array in outputs.items():
        got = torch.from_numpy(array)
        assert got.shape == tuple(c["x"].shape), name
        assert relative_error(got, expected[name]) <= TOLERANCE, name


def test_wheel_contents_and_metadata(wheel):
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        (meta_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        meta = zf.read(meta_name).decode()
    assert not [n for n in names if any(bad in n for bad in LEFTOVERS)], names
    assert {n.split("/")[0] for n in names} == {"expertd", meta_name.split("/")[0]}
    for needed in (
        "expertd/cli.py",
        "expertd/client/sync.py",
        "expertd/server/app.py",
        "expertd/kernels/csrc/",
        "expertd/v1/inference_pb2.py",
        "expertd/v1/expertd.proto",
        "expertd/v1/expertd_pb2.pyi",
    ):
        assert any(n.startswith(needed) for n in names), needed
    head, _, body = meta.partition("\n\n")
    assert "Description-Content-Type: text/markdown" in head
    assert "License-Expression: Apache-2.0" in head and "Classifier: " in head
    assert body.startswith("# expertd")
    base = sorted(
        re.split(r"[<>=!~ ;]", line.split(": ", 1)[1])[0]
        for line in head.splitlines()
        if line.startswith("Requires-Dist: ") and "extra ==" not in line
    )
    assert base == ["grpcio", "numpy", "protobuf"], base
    server = {
        re.split(r"[<>=!~ ;]", line.split(": ", 1)[1])[0]
        for line in head.splitlines()
        if line.startswith("Requires-Dist: ") and 'extra == "server"' in line
    }
    assert {"torch", "safetensors", "prometheus-client", "ninja"} <= server, server


def test_client_only_install(wheel, torch_links, addresses, cases, full_layers, tmp_path):
    python = make_venv(tmp_path / "venv", torch_links)
    pip_install(python, str(wheel))
    outputs, report = frontend(python, "client", addresses, cases, tmp_path)
    assert report["present"] == [] and report["present_after"] == [], report
    assert report["expertd_file"].startswith(str(tmp_path / "venv")), report
    assert report["ours_live"]
    check_outputs(outputs, cases, full_layers, tmp_path / "venv")
    # The command line is the server's: without the extra it says what to install.
    cli = run([python.with_name("expertd"), "--help"], timeout=120, cwd=tmp_path)
    assert cli.returncode == 0 or "expertd[server]" in cli.stderr, cli.stderr
    assert "Traceback" not in cli.stderr, cli.stderr


@pytest.mark.slow
def test_beside_tritonclient(wheel, torch_links, addresses, cases, full_layers, tmp_path):
    python = make_venv(tmp_path / "venv", torch_links)
    pip_install(python, str(wheel), "tritonclient[grpc]", "ml_dtypes")
    outputs, report = frontend(python, "tritonclient", addresses, cases, tmp_path)
    assert report["protobuf"].startswith("6."), report  # tritonclient's pin, not ours
    assert report["other_live"] and report["ours_live"], report
    assert report["other_inputs"] == ["hidden_states", "topk_ids", "topk_weights"]
    assert sorted(outputs) == ["client", "other", "ours"]
    check_outputs(outputs, cases, full_layers, tmp_path / "venv")


@pytest.mark.slow
def test_beside_kserve(wheel, torch_links, addresses, cases, full_layers, tmp_path):
    python = make_venv(tmp_path / "venv", torch_links)
    pip_install(python, str(wheel), "kserve")
    outputs, report = frontend(python, "kserve", addresses, cases, tmp_path)
    assert report["protobuf"].startswith("6."), report  # kserve's pin, not ours
    assert report["other_live"] and report["ours_live"], report
    assert report["other_inputs"] == ["hidden_states", "topk_ids", "topk_weights"]
    assert sorted(outputs) == ["client", "other", "ours"]
    check_outputs(outputs, cases, full_layers, tmp_path / "venv")


SUITE_PART = ("tests/unit/test_codec.py", "tests/unit/test_checkpoint.py")


@pytest.mark.slow
def test_installed_wheel_runs_the_suite(wheel, torch_links, tmp_path):
    """`expertd[server]` from the wheel (non-editable) runs part of the suite, from a
    folder outside the checkout so the installed copy is the one imported."""
    python = make_venv(tmp_path / "venv", torch_links)
    pip_install(python, f"{wheel}[server]", "pytest>=8", "hypothesis>=6")
    where = run(
        [python, "-c", "import expertd.server, expertd.v1; print(expertd.__file__)"],
        cwd=tmp_path,
    )
    assert where.stdout.startswith(str(tmp_path / "venv")), where.stdout + where.stderr
    done = run(
        [
            python,
            "-m",
            "pytest",
            "-x",
            "-q",
            "-p",
            "no:cacheprovider",
            *(ROOT / t for t in SUITE_PART),
        ],
        timeout=900,
        cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert re.search(r"\d+ passed", done.stdout) and " failed" not in done.stdout
