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
    python benchmarks/carry_libs.py b48=@tree --row "b48=wg:X(48, 2, 1, 2, 3, 3, 2, 1, 2, 3, 3)"

NAME=REV builds revision REV (a branch, tag or commit) as .carry/NAME/; NAME=@tree builds the
working tree there, and a suffix :-DEXPERTD_...=v ... adds EXPERTD_KERNEL_DEFINES. --tree also
rebuilds .carry/kernels/ (emptied first: stale keys would travel with every call). --row
NAME=TABLE:X(BT, ...) builds NAME from a copy of its sources whose row for tile size BT in the
v8 (`wg`) or v6 (`v6`) configuration table is replaced (the working tree is never edited).
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


TABLES = {"wg": "EXPERTD_FOR_EACH_WG_CONFIG", "v6": "EXPERTD_FOR_EACH_CONFIG"}
KERNEL_SOURCE = Path("kernels") / "csrc" / "moe_nvfp4.cu"


@dataclass(frozen=True)
class Spec:
    name: str
    rev: str  # "@tree" or a git revision
    defines: str  # EXPERTD_KERNEL_DEFINES for this build ("" for none)
    rows: tuple[tuple[str, str], ...] = ()  # (table, "X(BT, ...)") rows replaced in the source


def parse_row(text: str) -> tuple[str, str, str]:
    """NAME=TABLE:X(BT, ...) -> (name, table, row); a clear error for anything else."""
    name, sep, rest = text.partition("=")
    table, sep2, row = rest.partition(":")
    if not sep or not sep2 or table not in TABLES:
        raise ValueError(f"expected NAME=wg:X(...) or NAME=v6:X(...), got {text!r}")
    if not re.fullmatch(r"X\(\d+(, \d+){10}\)", row.strip()):
        raise ValueError(f"{name}: a row is X(BT, ...) with 11 integers, got {row!r}")
    return name, table, row.strip()


def replace_row(source: str, table: str, row: str) -> str:
    """source with the row of configuration table `table` for row's tile size replaced by row."""
    bt = re.match(r"X\((\d+),", row).group(1)
    lines = source.splitlines(keepends=True)
    head = f"#define {TABLES[table]}(X)"
    try:
        i = next(n for n, line in enumerate(lines) if line.startswith(head))
    except StopIteration:
        raise ValueError(f"no {head} in the kernel source") from None
    while lines[i].rstrip().endswith("\\"):
        i += 1
        if re.match(rf"\s*X\({bt},", lines[i]):
            lines[i] = re.sub(r"X\([^)]*\)", row, lines[i], count=1)
            return "".join(lines)
    raise ValueError(f"table {table} has no row for tile size {bt}")


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


def apply_rows(source: str, rows: tuple[tuple[str, str], ...]) -> str:
    """source with each (table, row) replaced (replace_row)."""
    for table, row in rows:
        source = replace_row(source, table, row)
    return source


def with_rows(src: Path, rows: tuple[tuple[str, str], ...]) -> None:
    """Replace the configuration rows in src's kernel source, in place (src is a copy)."""
    if rows:
        path = src / KERNEL_SOURCE
        path.write_text(apply_rows(path.read_text(), rows))


def build_spec(spec: Spec, carry: Path) -> Path:
    """Build one Spec into carry/NAME/; the copied library's path."""
    with tempfile.TemporaryDirectory(prefix=f"carry-{spec.name}-") as tmp:
        cache = Path(tmp) / "cache"
        if spec.rev == "@tree" and spec.rows:
            tree = Path(tmp) / "tree"
            shutil.copytree(
                ROOT / "kernels", tree / "kernels", ignore=shutil.ignore_patterns("__pycache__")
            )
            with_rows(tree, spec.rows)
            lib = build(tree, cache, spec.defines)
        elif spec.rev == "@tree":
            lib = build(ROOT, cache, spec.defines)
        else:
            tree = Path(tmp) / "tree"
            git = ["git", "-C", str(ROOT)]
            subprocess.run(
                [*git, "worktree", "add", "-q", "--detach", str(tree), spec.rev], check=True
            )
            try:
                with_rows(tree, spec.rows)
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
    ap.add_argument(
        "--row",
        action="append",
        default=[],
        help="NAME=wg:X(BT, ...) or NAME=v6:X(...): a configuration row for spec NAME (repeatable)",
    )
    args = ap.parse_intermixed_args()
    try:
        specs = [parse_spec(s) for s in args.specs]
        rows = [parse_row(r) for r in args.row]
        unknown = {name for name, _, _ in rows} - {s.name for s in specs}
        if unknown:
            raise ValueError(f"--row for {sorted(unknown)}, which no spec names")
        specs = [
            Spec(s.name, s.rev, s.defines, tuple((t, r) for n, t, r in rows if n == s.name))
            for s in specs
        ]
        source = (ROOT / KERNEL_SOURCE).read_text()
        for spec in specs:  # every row checked before any build, not found late in one
            apply_rows(source, spec.rows)
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
        extra = "".join(f" {t}:{r}" for t, r in spec.rows) + (
            f" {spec.defines}" if spec.defines else ""
        )
        print(f"{spec.name} ({spec.rev}{extra}) -> {libs[-1][1]}", flush=True)
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
