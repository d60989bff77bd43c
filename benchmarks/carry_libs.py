"""Build the kernel libraries a device call compares, here on the CPU machine, into .carry/.

Each library A/B (benchmarks/lib_ab.py) needs the working tree's library in .carry/kernels/<key>/
(where the device's EXPERTD_KERNEL_CACHE finds it for the tree it receives) and each other build
as .carry/<name>/libexpertd_kernels.so. This script does those steps of the runbook
(kernels/NOTES.md) in one command: git revisions are built in temporary worktrees, one after
another (two CPU cores here: parallel nvcc runs only slow each other down), and --sass compares
every library's per-function SASS with the first one's (cuobjdump, e.g. from a scratch
`pip install triton`), which says which kernels a change touched before any device time is spent.

    python benchmarks/carry_libs.py --tree main=main draft=s13-my-draft --sass
    python benchmarks/carry_libs.py var=@tree:-DEXPERTD_X=1   # a compile-time variant of the tree

NAME=REV builds revision REV (a branch, tag or commit) as .carry/NAME/; NAME=@tree builds the
working tree there, and a suffix :-DEXPERTD_...=v ... adds EXPERTD_KERNEL_DEFINES. --tree also
rebuilds .carry/kernels/ (emptied first: stale keys would travel with every call).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIB = "libexpertd_kernels.so"


@dataclass(frozen=True)
class Spec:
    name: str
    rev: str  # "@tree" or a git revision
    defines: str  # EXPERTD_KERNEL_DEFINES for this build ("" for none)


def parse_spec(text: str) -> Spec:
    """NAME=REV[:-DEXPERTD_X=v ...] -> Spec; a clear error for anything else."""
    name, sep, rest = text.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or not rest:
        raise ValueError(f"expected NAME=REV or NAME=@tree[:-DEXPERTD_X=v ...], got {text!r}")
    if name == "kernels":
        raise ValueError("'kernels' is the tree's cache directory (--tree), not a library name")
    rev, _, defines = rest.partition(":")
    bad = [d for d in defines.split() if not d.startswith("-DEXPERTD_")]
    if bad:
        raise ValueError(f"{name}: defines must be -DEXPERTD_... macros, not {bad}")
    return Spec(name, rev, defines.strip())


def build(src: Path, cache: Path, defines: str = "") -> Path:
    """Build src's kernels into the cache directory `cache`; the library's path."""
    env = dict(os.environ, EXPERTD_KERNEL_CACHE=str(cache))
    env.pop("EXPERTD_KERNEL_LIB", None)
    env.pop("EXPERTD_KERNEL_TIMELINE", None)
    if defines:
        env["EXPERTD_KERNEL_DEFINES"] = defines
    else:
        env.pop("EXPERTD_KERNEL_DEFINES", None)
    out = subprocess.run(
        [sys.executable, str(src / "kernels" / "build.py")],
        env=env,
        capture_output=True,
        text=True,
    )
    if out.returncode:
        sys.exit(f"build of {src} failed:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
    return Path(out.stdout.strip().splitlines()[-1])


def build_spec(spec: Spec, carry: Path) -> Path:
    """Build one Spec into carry/NAME/; the copied library's path."""
    with tempfile.TemporaryDirectory(prefix=f"carry-{spec.name}-") as tmp:
        cache = Path(tmp) / "cache"
        if spec.rev == "@tree":
            lib = build(ROOT, cache, spec.defines)
        else:
            tree = Path(tmp) / "tree"
            git = ["git", "-C", str(ROOT)]
            subprocess.run(
                [*git, "worktree", "add", "-q", "--detach", str(tree), spec.rev], check=True
            )
            try:
                lib = build(tree, cache, spec.defines)
            finally:
                subprocess.run([*git, "worktree", "remove", "--force", str(tree)], check=True)
        dest = carry / spec.name
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        shutil.copy2(lib, dest / LIB)
    return dest / LIB


def sass_functions(text: str) -> dict[str, list[str]]:
    """cuobjdump --dump-sass output -> {function: its instructions}, with the anonymous
    namespace's per-build hash and the instruction addresses stripped (so two builds of the
    same code compare equal)."""
    text = re.sub(r"_GLOBAL__N__[0-9a-f_]*", "", text)
    funcs: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        m = re.match(r"\s+Function : (\S+)", line)
        if m:
            current = m.group(1)
            funcs[current] = []
        elif current and re.search(r"/\*[0-9a-f]{4}\*/", line):
            funcs[current].append(re.sub(r"/\*[0-9a-f]{4}\*/", "", line).split(";")[0].strip())
    return funcs


def compare(base: dict[str, list[str]], other: dict[str, list[str]]) -> dict[str, list[str]]:
    """Function names by status: same, differ, only_base, only_other."""
    return {
        "same": sorted(f for f in base if f in other and base[f] == other[f]),
        "differ": sorted(f for f in base if f in other and base[f] != other[f]),
        "only_base": sorted(set(base) - set(other)),
        "only_other": sorted(set(other) - set(base)),
    }


def find_cuobjdump(given: str | None) -> str | None:
    if given:
        return given
    found = shutil.which("cuobjdump")
    if found:
        return found
    for root in (Path("/tmp/tvenv/lib"), Path(sys.prefix) / "lib"):
        hits = sorted(root.glob("python3*/site-packages/triton/backends/nvidia/bin/cuobjdump"))
        if hits:
            return str(hits[0])
    return None


def short(name: str) -> str:
    """A mangled kernel name without its namespace prefix (readable in a table)."""
    return re.sub(r"^_ZN\d+moe_nvfp4_cu_\d+", "", name)[:110]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("specs", nargs="*", help="NAME=REV or NAME=@tree[:-DEXPERTD_X=v ...]")
    ap.add_argument("--tree", action="store_true", help="rebuild .carry/kernels for the tree")
    ap.add_argument("--sass", action="store_true", help="compare SASS with the first library")
    ap.add_argument("--cuobjdump", default=None, help="path of cuobjdump (default: searched)")
    ap.add_argument("--carry", default=str(ROOT / ".carry"))
    args = ap.parse_args()
    try:
        specs = [parse_spec(s) for s in args.specs]
    except ValueError as e:
        sys.exit(str(e))
    if not specs and not args.tree:
        sys.exit("nothing to build: give NAME=REV specs and/or --tree")
    carry = Path(args.carry)
    libs: list[tuple[str, Path]] = []
    if args.tree:
        kernels = carry / "kernels"
        shutil.rmtree(kernels, ignore_errors=True)
        libs.append(("tree", build(ROOT, kernels)))
        print(f"tree -> {libs[-1][1]}", flush=True)
    for spec in specs:
        libs.append((spec.name, build_spec(spec, carry)))
        print(
            f"{spec.name} ({spec.rev}{' ' + spec.defines if spec.defines else ''}) -> {libs[-1][1]}",
            flush=True,
        )
    if not args.sass or len(libs) < 2:
        return
    tool = find_cuobjdump(args.cuobjdump)
    if tool is None:
        sys.exit("no cuobjdump found (pip install triton in a scratch venv, or --cuobjdump PATH)")

    def dump(lib: Path) -> dict[str, list[str]]:
        out = subprocess.run(
            [tool, "--dump-sass", str(lib)], capture_output=True, text=True, check=True
        )
        return sass_functions(out.stdout)

    base_name, base_lib = libs[0]
    base = dump(base_lib)
    for name, lib in libs[1:]:
        c = compare(base, dump(lib))
        print(
            f"{name} against {base_name}: {len(c['same'])} functions the same, {len(c['differ'])} "
            f"differ, {len(c['only_base'])} only in {base_name}, {len(c['only_other'])} only in {name}"
        )
        for status in ("differ", "only_base", "only_other"):
            for f in c[status]:
                print(f"  {status:10s} {short(f)}")


if __name__ == "__main__":
    main()
