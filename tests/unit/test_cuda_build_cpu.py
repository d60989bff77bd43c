"""CPU checks of the kernel build glue (no nvcc needed): the ninja file, the cache key and the
environment overrides."""

from __future__ import annotations

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
    monkeypatch.setenv("EXPERTD_KERNEL_LIB", str(lib))
    assert build.library_path() == Path(lib)


def test_cache_key_depends_on_sources_and_flags(fake_nvcc, monkeypatch):
    key = build.build_key(str(fake_nvcc))
    assert key == build.build_key(str(fake_nvcc))  # stable
    monkeypatch.setattr(build, "NVCC_FLAGS", (*build.NVCC_FLAGS, "-DEXTRA"))
    assert build.build_key(str(fake_nvcc)) != key


def test_timeline_build_is_a_separate_library(fake_nvcc, tmp_path, monkeypatch):
    """EXPERTD_KERNEL_TIMELINE=1 adds -DEXPERTD_TIMELINE: another cache key, so the production
    library (no marks) and the instrumented one live side by side."""
    monkeypatch.delenv("EXPERTD_KERNEL_TIMELINE", raising=False)
    plain = build.build_key(str(fake_nvcc))
    assert "-DEXPERTD_TIMELINE" not in build._ninja_file(str(fake_nvcc), tmp_path)
    monkeypatch.setenv("EXPERTD_KERNEL_TIMELINE", "1")
    assert build.build_key(str(fake_nvcc)) != plain
    assert "-DEXPERTD_TIMELINE" in build._ninja_file(str(fake_nvcc), tmp_path)


def test_defines_build_a_separate_library(fake_nvcc, tmp_path, monkeypatch):
    """EXPERTD_KERNEL_DEFINES adds its -DEXPERTD_ macros (another cache key: a compile-time variant
    for a library A/B lives beside the default) and refuses any other flag."""
    monkeypatch.delenv("EXPERTD_KERNEL_DEFINES", raising=False)
    plain = build.build_key(str(fake_nvcc))
    monkeypatch.setenv("EXPERTD_KERNEL_DEFINES", "-DEXPERTD_A=1 -DEXPERTD_B=2")
    assert build.build_key(str(fake_nvcc)) != plain
    text = build._ninja_file(str(fake_nvcc), tmp_path)
    assert "-DEXPERTD_A=1" in text and "-DEXPERTD_B=2" in text
    monkeypatch.setenv("EXPERTD_KERNEL_DEFINES", "-O0")
    with pytest.raises(ValueError, match="-DEXPERTD_"):
        build.nvcc_flags()


def test_args_mirror_and_owned_range():
    """The ctypes mirror of ExpertdMoeArgs ends with local_first, and a shard's experts pass as a
    range (no table lookups in the kernels) only when they are consecutive ids in order."""
    from expertd.kernels import cuda

    assert [name for name, _ in cuda._Args._fields_][-2:] == ["stream", "local_first"]
    assert cuda._range_start((32, 33, 34, 35)) == 32
    assert cuda._range_start((0,)) == 0
    assert cuda._range_start((3, 70, 128, 255)) == -1
    assert cuda._range_start((5, 4)) == -1
    assert cuda._range_start(()) == -1
