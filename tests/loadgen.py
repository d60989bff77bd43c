"""Load whose answers are known in advance: the reliability tests and
benchmarks/soak.py drive the real client with it.

A pool of calls is made once, each with its expected output from the dense
reference (experts dequantized once per layer, not per call), so checking
every result under load costs a comparison, not a forward. Callers are threads
over a few shared `ExpertClient`s plus asyncio tasks over one
`AsyncExpertClient`, as a frontend would have them. A `Tally` keeps every
latency, every error (kind, and how long the failed call took) and every
wrong result.
"""

from __future__ import annotations

import asyncio
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field

import torch

from expertd.aioloop import run
from expertd.client import AsyncExpertClient, ExpertClient, ExpertdError
from expertd.kernels import relative_error
from expertd.kernels.reference import dense_weights, moe_forward_dense

TOL = 1e-2  # normalized error; a lost shard's contribution is ~1/top_k, far above it
SIZES = (1, 3, 8, 17, 32)  # tokens per call: decode-like and small prefill, odd sizes too
# After a failed call a caller waits this long, as a frontend would, instead of spinning on
# instant CoverageErrors and starving its own process (the deadlines measured are the client's).
ERROR_PAUSE_S = 0.05


@dataclass(frozen=True, slots=True)
class Case:
    layer: int
    x: torch.Tensor  # bf16 [M, H]
    ids: torch.Tensor  # int32 [M, K]
    w: torch.Tensor  # fp32 [M, K]
    want: torch.Tensor  # fp32 [M, H]: the reference

    @property
    def args(self):
        return self.layer, self.x, self.ids, self.w


def outcomes(futures) -> list:
    """Each gRPC call future's reply, or the RpcError it ended with, in order."""
    import grpc

    out = []
    for f in futures:
        try:
            out.append(f.result())
        except grpc.RpcError as e:
            out.append(e)
    return out


def make_cases(full_layers, n: int, seed: int = 0, layers=(0,), sizes=SIZES) -> list[Case]:
    """n calls with router-like top-k routing over every expert, and their answers."""
    gen = torch.Generator().manual_seed(seed)
    dense = {layer: _dense(full_layers[layer]) for layer in layers}
    cases = []
    for i in range(n):
        layer, m = layers[i % len(layers)], sizes[i % len(sizes)]
        w13, w2, norm, local_of = dense[layer]
        h, e = w2.shape[1], local_of.numel() - 1
        x = torch.randn((m, h), generator=gen).to(torch.bfloat16)
        top = torch.randn((m, e), generator=gen).topk(8, dim=1)
        ids, w = top.indices.to(torch.int32), torch.softmax(top.values, dim=1)
        want = moe_forward_dense(w13, w2, norm, local_of, x, ids, w)
        cases.append(Case(layer, x, ids, w, want))
    return cases


def _dense(layer):
    return (*dense_weights(layer, torch.float32), layer.global_to_local("cpu"))


@dataclass
class Tally:
    """Outcomes of every call, from any thread."""

    latencies: list[float] = field(default_factory=list)  # s, successful calls
    tokens: int = 0
    wrong: list[str] = field(default_factory=list)  # results off the reference
    errors: Counter = field(default_factory=Counter)  # "ShardCallError: UNAVAILABLE" -> count
    error_seconds: dict[str, float] = field(default_factory=dict)  # kind -> longest failed call
    samples: list[str] = field(default_factory=list)  # the first few error messages
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def ok(self, case: Case, out: torch.Tensor, seconds: float) -> None:
        err = relative_error(out, case.want)
        with self._lock:
            self.latencies.append(seconds)
            self.tokens += case.x.shape[0]
            if not err <= TOL:
                self.wrong.append(f"M={case.x.shape[0]}: relative error {err:.3g}")

    def fail(self, exc: Exception, seconds: float) -> None:
        code = getattr(exc, "code", None)
        kind = type(exc).__name__ + (f": {code.name}" if hasattr(code, "name") else "")
        # Our own errors explain themselves; anything else is a bug: keep where it came from.
        text = str(exc) if isinstance(exc, ExpertdError) else traceback.format_exc(limit=-4)
        with self._lock:
            self.errors[kind] += 1
            self.error_seconds[kind] = max(self.error_seconds.get(kind, 0.0), seconds)
            if len(self.samples) < 5 or kind not in "".join(self.samples):
                self.samples.append(f"{kind}: {text}")

    @property
    def calls(self) -> int:
        return len(self.latencies) + sum(self.errors.values())

    def summary(self, elapsed: float) -> dict:
        lat = sorted(self.latencies)
        pick = lambda q: round(1e3 * lat[int(q * (len(lat) - 1))], 2) if lat else None  # noqa: E731
        return {
            "calls": self.calls,
            "ok": len(lat),
            "errors": sum(self.errors.values()),
            "error_kinds": dict(self.errors),
            "wrong": len(self.wrong),
            "p50_ms": pick(0.5),
            "p99_ms": pick(0.99),
            "tokens_per_s": round(self.tokens / elapsed, 1) if elapsed else None,
            "max_error_s": {k: round(v, 3) for k, v in self.error_seconds.items()},
            "seconds": round(elapsed, 2),
        }


def _pick(cases, worker: int, turn: int, workers: int) -> Case:
    return cases[(worker + turn * workers) % len(cases)]


def _thread_worker(client, cases, worker, workers, end, tally, timeout) -> None:
    turn = 0
    while time.monotonic() < end:
        case = _pick(cases, worker, turn, workers)
        turn += 1
        t0 = time.monotonic()
        try:
            out = client.forward(*case.args, timeout=timeout)
        except Exception as e:  # every failure is counted, whatever it is
            tally.fail(e, time.monotonic() - t0)
            time.sleep(ERROR_PAUSE_S)
        else:
            tally.ok(case, out, time.monotonic() - t0)


async def _async_load(addresses, cases, tasks, offset, workers, end, tally, options) -> None:
    async with await AsyncExpertClient.connect(addresses, **options) as client:

        async def worker(i: int) -> None:
            turn = 0
            while time.monotonic() < end:
                case = _pick(cases, offset + i, turn, workers)
                turn += 1
                t0 = time.monotonic()
                try:
                    out = await client.forward(*case.args)
                except Exception as e:
                    tally.fail(e, time.monotonic() - t0)
                    await asyncio.sleep(ERROR_PAUSE_S)
                else:
                    tally.ok(case, out, time.monotonic() - t0)

        await asyncio.gather(*(worker(i) for i in range(tasks)))


def run_load(
    addresses: list[str],
    cases: list[Case],
    duration: float,
    threads: int = 32,
    tasks: int = 32,
    sync_clients: int = 4,
    during=None,
    **options,
) -> tuple[Tally, float]:
    """`threads` callers over `sync_clients` ExpertClients and `tasks` asyncio callers
    over one AsyncExpertClient, for `duration` s; `during()` runs on this thread
    meanwhile (a fault schedule). options: client options (timeout, ...).
    -> (tally, seconds the load ran)."""
    tally = Tally()
    clients = [ExpertClient(addresses, **options) for _ in range(sync_clients)]
    workers = threads + tasks
    timeout = options.get("timeout")
    t0 = time.monotonic()
    end = t0 + duration
    pool = [
        threading.Thread(
            target=_thread_worker,
            args=(clients[i % sync_clients], cases, i, workers, end, tally, timeout),
        )
        for i in range(threads)
    ]
    if tasks:
        load = _async_load(addresses, cases, tasks, threads, workers, end, tally, options)
        pool.append(threading.Thread(target=run, args=(load, "expertd-load")))
    try:
        for t in pool:
            t.start()
        if during is not None:
            during()
        for t in pool:
            t.join()
    finally:
        for client in clients:
            client.close()
    return tally, time.monotonic() - t0


def rss_mib(pid: int) -> float:
    """Resident set size of a process, MiB (Linux /proc)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")
