"""Search for the cheapest E2M1 -> bf16 bit layout (kernels/NOTES.md, session 7).

The kernel turns one 32-bit code word q (8 E2M1 codes) into 4 registers of 2 bf16 each: every
value's sign goes to bit 15 and its 3 magnitude bits to bits 6-8 (+ 16 for the second value),
i.e. the bits P = {6, 7, 8, 15, 22, 23, 24, 31} of each register. The repack may put each code
bit anywhere in q, so a layout is a choice, per register, of the operations that move 8 bits of q
onto P; the 4 registers' source bits must cover q's 32 bits exactly once. Operation menu (ops):

    A  q & P                                     1
    B  translate (shl / shr / rotate) then & P   2
    R  byte permute (PRMT) then & P              2
    C  ((q & M) * (2^a + 2^b [+ 2^c])) & P       3   (carry-free: the shifted copies never overlap)
    Q  PRMT, rotate, & P                         3

Prints the cheapest exact cover (depth-first search, at most one A). Session 7, whose multiplies
made two copies: 10 ops (two rotations and two multiplies); none with 9. Session 23, with three
copies: 8 ops (the mask, two rotations and one multiply: the layout kernels/repack.py uses).

    python benchmarks/e2m1_layout_search.py   # ~4 minutes on one CPU core
"""

from __future__ import annotations

import itertools

P = (6, 7, 8, 15, 22, 23, 24, 31)
PSET = frozenset(P)
FULL = (1 << 32) - 1


def mask(bits) -> int:
    return sum(1 << b for b in bits)


def translates() -> dict[int, tuple]:
    out: dict[int, tuple] = {}
    for t in range(1, 32):
        for kind, src in (
            ("rot", [(p - t) % 32 for p in P]),
            ("shl", [p - t for p in P]),
            ("shr", [p + t for p in P]),
        ):
            if all(0 <= x < 32 for x in src) and len(set(src)) == 8:
                out.setdefault(mask(src), (kind, t))
    return out


def permutes(rotate: bool) -> dict[int, tuple]:
    out: dict[int, tuple] = {}
    for t in range(1, 32) if rotate else (0,):
        pre = [(p - t) % 32 for p in P]  # bit positions in the permuted word
        for pi in itertools.product(range(4), repeat=4):
            src = {8 * pi[x // 8] + x % 8 for x in pre}
            if len(src) == 8:
                out.setdefault(mask(src), ("prmt+rot", pi, t) if rotate else ("prmt", pi))
    return out


def _feeds(shifts: tuple, i: int, src: frozenset, fed: tuple, out: dict) -> None:
    """Depth-first over P's bits: bit P[i] takes q bit P[i] - s for one s of `shifts`."""
    if i == len(P):
        copies = [{m + s for m in src if m + s < 32} for s in shifts]
        if any(x & y for x, y in itertools.combinations(copies, 2)):
            return  # overlapping copies would carry
        for s, c in zip(shifts, copies, strict=True):
            if not c or c & PSET != {p for p, f in zip(P, fed, strict=True) if f == s}:
                return
        out.setdefault(mask(src), ("mul", shifts))
        return
    for s in shifts:
        if P[i] - s >= 0 and P[i] - s not in src:
            _feeds(shifts, i + 1, src | {P[i] - s}, (*fed, s), out)


def multiplies(max_copies: int = 3) -> dict[int, tuple]:
    """((q & M) * sum of 2^s over S) & P for 2 <= |S| <= max_copies: every p of P takes bit p - s
    of q for one s of S, and the |S| shifted copies of M are pairwise disjoint (no carries), each
    meeting P exactly in the bits it feeds. Session 7's menu stopped at two copies."""
    out: dict[int, tuple] = {}
    for k in range(2, max_copies + 1):
        for shifts in itertools.combinations(range(32), k):
            _feeds(shifts, 0, frozenset(), (), out)
    return out


def main() -> None:
    menu = [(mask(P), 1, ("and",))]
    for table, cost in (
        (translates(), 2),
        (permutes(False), 2),
        (multiplies(), 3),
        (permutes(True), 3),
    ):
        menu += [(m, cost, d) for m, d in table.items()]
    by_bit = {b: [it for it in menu if it[0] >> b & 1] for b in range(32)}
    best: list = [99, []]

    def dfs(used: int, chosen: list, cost: int) -> None:
        if cost >= best[0] or len(chosen) > 4:
            return
        if used == FULL:
            if len(chosen) == 4:
                best[0], best[1] = cost, list(chosen)
            return
        free = ~used & FULL
        low = (free & -free).bit_length() - 1  # every cover must take the lowest free bit
        for it in by_bit[low]:
            if it[0] & used or (it[2][0] == "and" and any(c[2][0] == "and" for c in chosen)):
                continue
            chosen.append(it)
            dfs(used | it[0], chosen, cost + it[1])
            chosen.pop()

    dfs(0, [], 0)
    print(f"menu: {len(menu)} source sets; cheapest exact cover: {best[0]} ops")
    for m, cost, desc in best[1]:
        print(f"  {cost} ops  {desc}  q bits {[b for b in range(32) if m >> b & 1]}")


if __name__ == "__main__":
    main()
