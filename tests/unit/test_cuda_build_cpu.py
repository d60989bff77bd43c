"""CPU checks of the kernel build glue (no nvcc needed): the ninja file, the cache key, the
environment variables it reads (cache, prebuilt library) and those it does not."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from expertd.kernels import build


@pytest.fixture
def fake_nvcc(tmp_path) -> Path:
    """An "nvcc" that only prints a version (the cache key reads it)."""
    nvcc = tmp_path / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 13.0'\n")
    nvcc.chmod(0o755)
    return nvcc


def test_ninja_file_targets_sm90a_and_every_source(tmp_path):
    text = build._ninja_file("/opt/cuda/bin/nvcc", tmp_path)
    assert "-gencode=arch=compute_90a,code=sm_90a" in text
    assert "--shared" in text and "-Xcompiler=-fPIC" in text
    for src in build.SOURCES:
        assert str(build.CSRC / src) in text
    assert f"build {tmp_path / build.LIB_NAME}: nvcc_so" in text


def test_cache_dir_and_prebuilt_library_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("EXPERTD_KERNEL_CACHE", str(tmp_path / "cache"))
    assert build.cache_dir() == (tmp_path / "cache").resolve()
    lib = tmp_path / "prebuilt.so"
    lib.write_bytes(b"")
    monkeypatch.setenv("EXPERTD_KERNEL_LIB", str(lib))
    assert build.library_path() == Path(lib)


def test_cache_key_depends_on_sources_and_flags(fake_nvcc, monkeypatch):
    key = build.build_key(str(fake_nvcc))
    assert key == build.build_key(str(fake_nvcc))  # stable
    monkeypatch.setattr(build, "NVCC_FLAGS", (*build.NVCC_FLAGS, "-DEXTRA"))
    assert build.build_key(str(fake_nvcc)) != key


def test_flags_and_cache_key_ignore_the_environment(fake_nvcc, tmp_path, monkeypatch):
    """The build takes its flags from NVCC_FLAGS only: no environment variable adds a define or
    another flag, so one library (one cache key) is the product kernel."""
    monkeypatch.delenv("EXPERTD_KERNEL_DEFINES", raising=False)
    monkeypatch.delenv("EXPERTD_KERNEL_TIMELINE", raising=False)
    key = build.build_key(str(fake_nvcc))
    text = build._ninja_file(str(fake_nvcc), tmp_path)
    assert f"flags = {' '.join(build.NVCC_FLAGS)}\n" in text
    monkeypatch.setenv("EXPERTD_KERNEL_DEFINES", "-DEXPERTD_X=1")
    monkeypatch.setenv("EXPERTD_KERNEL_TIMELINE", "1")
    assert build.build_key(str(fake_nvcc)) == key
    assert build._ninja_file(str(fake_nvcc), tmp_path) == text


def test_kernel_source_reads_no_environment():
    """The kernel library has no run-time switches: nothing in its sources reads the
    environment, and no source is compiled out by a -D macro of ours."""
    for path in build.CSRC.iterdir():
        if path.suffix in (".cu", ".cuh", ".h"):
            text = path.read_text()
            assert "getenv" not in text, path.name
            assert "#ifdef EXPERTD" not in text and "#ifndef EXPERTD" not in text, path.name


def test_args_mirror_and_owned_range():
    """The ctypes mirror of ExpertdMoeArgs has the C struct's fields in its order, and a shard's
    experts pass as a range (no table lookups in the kernels) only when they are consecutive
    ids in order."""
    from expertd.kernels import cuda

    source = (build.CSRC / "moe_nvfp4.cu").read_text()
    body = re.search(r"struct ExpertdMoeArgs \{(.*?)\n\};", source, re.S).group(1)
    fields = re.findall(r"^\s*[\w\s\*]+?[\s\*](\w+);", body, re.M)
    assert [name for name, _ in cuda._Args._fields_] == fields
    assert fields[-3:] == ["stream", "local_first", "rms_norm"]
    assert cuda._range_start((32, 33, 34, 35)) == 32
    assert cuda._range_start((0,)) == 0
    assert cuda._range_start((3, 70, 128, 255)) == -1
    assert cuda._range_start((5, 4)) == -1
    assert cuda._range_start(()) == -1


def test_compiled_kernels_only_for_compute_capability_9_0():
    """sm_90a code runs on 9.0 alone: an A100 (8.0) or a B200 (10.0) gets the reason."""
    assert build.capability_problem("cuda:0 (NVIDIA H200)", (9, 0)) is None
    for cap in ((8, 0), (8, 9), (10, 0), (12, 0)):
        why = build.capability_problem("cuda:0 (some GPU)", cap)
        assert f"compute capability {cap[0]}.{cap[1]}" in why and "sm_90a" in why


def test_backend_choice_on_cpu_is_the_reference_with_a_reason(caplog):
    import logging

    import torch

    from expertd.kernels import lookup

    name, why = lookup.choose_backend(torch.device("cpu"))
    assert name == "reference" and "CUDA device" in why
    with caplog.at_level(logging.INFO, logger="expertd.kernels"):
        assert lookup.default_backend_name(torch.device("cpu")) == "reference"
    assert lookup.last_choice() == (name, why)
    assert [r.getMessage() for r in caplog.records] == [f"backend reference: {why}"]
    with pytest.raises(ValueError, match="backend cuda: the compiled kernels run on CUDA"):
        lookup.create_backend("cuda", "cpu")


def test_missing_prebuilt_library_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("EXPERTD_KERNEL_LIB", str(tmp_path / "absent.so"))
    with pytest.raises(RuntimeError, match=r"EXPERTD_KERNEL_LIB=.*absent\.so: no such file"):
        build.library_path()
    assert build.library_path(build=False) == tmp_path / "absent.so"
