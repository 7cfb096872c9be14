"""Tool benchmarks: the code sandbox, the search tool and MCP servers, on this machine.

Sandbox (``turnrl.tools.PythonInterpreter``), per mode (bubblewrap where it runs, the
rlimit-only fallback) beside a peer: a bare ``python3 -c`` subprocess per call, what a
framework without a persistent interpreter pays, with no isolation at all:
- cold: start an interpreter, run ``print(1)``, close it (ms, median and p90);
- persistent: one more call on a warm interpreter (ms, median and p90);
- calls/s with N concurrent episodes, each with its own warm interpreter, every call a
  small computation (the peer: N concurrent fresh subprocesses).
Search (``turnrl.tools.SearchIndex``, bm25s) over a synthetic collection: index build time,
queries per second one at a time, in batches, and through the tool (ranked text out).
MCP (tests/mcp_server.py, a real server on the ``mcp`` SDK) over stdio and streamable
HTTP: connect + list tools, call latency, calls/s with 16 concurrent callers on one session.

    python benchmarks/tools.py                 # everything (~2 minutes)
    python benchmarks/tools.py --quick         # fewer repetitions
    python benchmarks/tools.py --smoke         # 2 repetitions, 2 calls, 500 documents

Writes benchmarks/results/tools.json and .md (``--out``; ``--smoke``: a temporary directory).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from contextlib import suppress
from pathlib import Path
from typing import Any

from outputs import parse_args
from turnrl.tools import (
    McpServer,
    PythonInterpreter,
    Sandbox,
    SandboxUnavailableError,
    SearchIndex,
)

ROOT = Path(__file__).resolve().parent
MCP_SERVER = ROOT.parent / "tests" / "mcp_server.py"
SMALL_CODE = "total = sum(i * i for i in range(1000))\ntotal"


def ms_stats(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return {"median_ms": 1000 * statistics.median(ordered), "p90_ms": 1000 * p90, "n": len(ordered)}


async def timed(fn: Callable[[], Awaitable[Any]]) -> float:
    t0 = time.perf_counter()
    await fn()
    return time.perf_counter() - t0


# --- sandbox ------------------------------------------------------------------------------


async def interpreter_cold(sandbox: Sandbox) -> None:
    async with PythonInterpreter(sandbox) as interp:
        result = await interp.run("print(1)")
        assert result.status == "ok", result


async def bare_call(code: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        "/usr/bin/python3", "-c", code, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    await proc.communicate()
    assert proc.returncode == 0


async def sandbox_throughput(sandbox: Sandbox | None, episodes: int, calls: int) -> float:
    """Calls per second: ``episodes`` concurrent episodes making ``calls`` calls each
    (interpreters warmed first); ``sandbox`` None: a fresh bare subprocess per call."""
    if sandbox is None:

        async def bare_episode() -> None:
            for _ in range(calls):
                await bare_call("print(sum(i * i for i in range(1000)))")

        t0 = time.perf_counter()
        await asyncio.gather(*(bare_episode() for _ in range(episodes)))
        return episodes * calls / (time.perf_counter() - t0)
    interps = [PythonInterpreter(sandbox) for _ in range(episodes)]
    try:
        await asyncio.gather(*(i.run("0") for i in interps))

        async def episode(interp: PythonInterpreter) -> None:
            for _ in range(calls):
                result = await interp.run(SMALL_CODE)
                assert result.status == "ok", result
                assert "332833500" in result.text, result

        t0 = time.perf_counter()
        await asyncio.gather(*(episode(i) for i in interps))
        return episodes * calls / (time.perf_counter() - t0)
    finally:
        await asyncio.gather(*(i.close() for i in interps))


async def bench_sandbox(reps: int, concurrency: list[int], calls: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    modes: list[str] = ["bwrap", "rlimit", "bare subprocess (peer, no isolation)"]
    for mode in modes:
        sandbox: Sandbox | None = None
        if mode in ("bwrap", "rlimit"):
            try:
                sandbox = Sandbox(mode)  # type: ignore[arg-type]
            except SandboxUnavailableError as exc:
                rows.append({"mode": mode, "unavailable": str(exc)})
                continue
        row: dict[str, Any] = {"mode": mode}
        if sandbox is not None:
            cold = [await timed(lambda s=sandbox: interpreter_cold(s)) for _ in range(reps)]
            async with PythonInterpreter(sandbox) as interp:
                await interp.run("x = 0")
                warm = [await timed(lambda: interp.run("x += 1\nx")) for _ in range(reps * 5)]
            row["cold"] = ms_stats(cold)
            row["persistent"] = ms_stats(warm)
        else:
            cold = [await timed(lambda: bare_call("print(1)")) for _ in range(reps)]
            row["cold"] = ms_stats(cold)
            row["persistent"] = None  # every call is a new process
        row["calls_per_s"] = {
            str(n): await sandbox_throughput(sandbox, n, calls) for n in concurrency
        }
        rows.append(row)
        print(f"sandbox {mode}: {json.dumps(row)}", flush=True)
    return rows


# --- search -------------------------------------------------------------------------------


def synthetic_collection(num_docs: int, seed: int = 0) -> list[dict[str, str]]:
    """Documents of 40-120 words drawn from a 20k-word vocabulary with Zipf-like weights."""
    rng = random.Random(seed)
    vocab = [f"w{i}" for i in range(20_000)]
    weights = [1.0 / (i + 1) for i in range(len(vocab))]
    docs = []
    for d in range(num_docs):
        words = rng.choices(vocab, weights, k=rng.randint(40, 120))
        docs.append({"id": str(d), "title": f"doc {d}", "text": " ".join(words)})
    return docs


def bench_search(sizes: list[int], num_queries: int) -> list[dict[str, Any]]:
    rows = []
    for size in sizes:
        docs = synthetic_collection(size)
        t0 = time.perf_counter()
        index = SearchIndex(docs)
        build_s = time.perf_counter() - t0
        rng = random.Random(1)
        # queries: three words from a random document, so every query has hits
        queries = [
            " ".join(rng.sample(rng.choice(docs)["text"].split(), 3)) for _ in range(num_queries)
        ]
        t0 = time.perf_counter()
        for q in queries:
            index.search(q, k=5)
        single = num_queries / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        index.search_batch(queries, k=5)
        batch = num_queries / (time.perf_counter() - t0)
        tool = index.as_tool(k=5)

        async def through_tool(tool: Any, queries: list[str]) -> None:
            for q in queries:
                result = await tool.invoke({"query": q})
                assert result.ok

        t0 = time.perf_counter()
        asyncio.run(through_tool(tool, queries))
        via_tool = num_queries / (time.perf_counter() - t0)
        row = {
            "documents": size, "index_build_s": build_s, "queries_per_s_single": single,
            "queries_per_s_batch": batch, "queries_per_s_tool": via_tool,
        }  # fmt: skip
        rows.append(row)
        print(f"search: {json.dumps(row)}", flush=True)
    return rows


# --- MCP ----------------------------------------------------------------------------------


def start_http_server() -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, str(MCP_SERVER), "http", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    for _ in range(600):
        with suppress(OSError):
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return proc, f"http://127.0.0.1:{port}/mcp"
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("the MCP test server did not start")


async def bench_mcp_one(server: McpServer, reps: int, calls: int) -> dict[str, Any]:
    connects = []
    for _ in range(max(2, reps // 2)):
        t0 = time.perf_counter()
        session = await server.connect()
        connects.append(time.perf_counter() - t0)
        await session.close()
    session = await server.connect()
    try:
        add = next(t for t in session.tools if t.name == "add")
        latencies = []
        for i in range(reps * 10):
            result = await add.invoke({"a": i, "b": 1})
            assert result.ok, result
            latencies.append(result.latency_s)

        async def caller() -> None:
            for i in range(calls):
                assert (await add.invoke({"a": i, "b": 1})).ok

        t0 = time.perf_counter()
        await asyncio.gather(*(caller() for _ in range(16)))
        throughput = 16 * calls / (time.perf_counter() - t0)
    finally:
        await session.close()
    return {
        "connect": ms_stats(connects),
        "call": ms_stats(latencies),
        "calls_per_s_16": throughput,
    }


def bench_mcp(reps: int, calls: int) -> list[dict[str, Any]]:
    rows = []
    stdio = McpServer([sys.executable, str(MCP_SERVER), "stdio"])
    rows.append({"transport": "stdio", **asyncio.run(bench_mcp_one(stdio, reps, calls))})
    print(f"mcp: {json.dumps(rows[-1])}", flush=True)
    proc, url = start_http_server()
    try:
        rows.append(
            {
                "transport": "streamable HTTP",
                **asyncio.run(bench_mcp_one(McpServer(url), reps, calls)),
            }
        )
    finally:
        proc.kill()
        proc.wait()
    print(f"mcp: {json.dumps(rows[-1])}", flush=True)
    return rows


# --- report -------------------------------------------------------------------------------


def markdown(meta: dict[str, Any], sandbox: list[dict[str, Any]], search: list[dict[str, Any]],
             mcp: list[dict[str, Any]]) -> list[str]:  # fmt: skip
    conc = meta["concurrency"]
    out = [
        f"# Tool benchmarks ({meta['date']}, {meta['machine']})",
        "",
        "## Code sandbox: one call of a small program",
        "",
        "| mode | cold start + call, median (p90) ms | persistent call, median (p90) ms | "
        + " | ".join(f"calls/s, {n} episodes" for n in conc)
        + " |",
        "|---|---|---|" + "---|" * len(conc),
    ]
    for r in sandbox:
        if "unavailable" in r:
            out.append(f"| {r['mode']} | unavailable: {r['unavailable']} |")
            continue
        warm = r["persistent"]
        out.append(
            f"| {r['mode']} | {r['cold']['median_ms']:.0f} ({r['cold']['p90_ms']:.0f}) | "
            + (
                f"{warm['median_ms']:.1f} ({warm['p90_ms']:.1f})"
                if warm
                else "n/a (new process per call)"
            )
            + " | "
            + " | ".join(f"{r['calls_per_s'][str(n)]:.0f}" for n in conc)
            + " |"
        )
    out += [
        "",
        "## Search (BM25, bm25s), top 5, three-word queries",
        "",
        "| documents | index build s | queries/s one by one | queries/s batched | queries/s through the tool |",
        "|---|---|---|---|---|",
    ]
    out += [
        f"| {r['documents']} | {r['index_build_s']:.2f} | {r['queries_per_s_single']:.0f} | "
        f"{r['queries_per_s_batch']:.0f} | {r['queries_per_s_tool']:.0f} |"
        for r in search
    ]
    out += [
        "",
        "## MCP (tests/mcp_server.py on the mcp SDK), tool `add`",
        "",
        "| transport | connect + list tools, median ms | call, median (p90) ms | calls/s, 16 concurrent callers |",
        "|---|---|---|---|",
    ]
    out += [
        f"| {r['transport']} | {r['connect']['median_ms']:.0f} | {r['call']['median_ms']:.1f} "
        f"({r['call']['p90_ms']:.1f}) | {r['calls_per_s_16']:.0f} |"
        for r in mcp
    ]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = parse_args(parser, "tools", {})
    reps = 4 if args.quick else 12
    concurrency = [1, 4, 16]
    calls = 5 if args.quick else 20
    sizes = [1_000, 10_000] if args.quick else [1_000, 10_000, 50_000]
    queries = 500 if args.quick else 2000
    if args.smoke:
        reps, concurrency, calls, sizes, queries = 2, [1, 2], 2, [500], 20
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {__import__('os').cpu_count()} cores",
        "python": platform.python_version(),
        "concurrency": concurrency,
        "calls_per_episode": calls,
    }
    sandbox = asyncio.run(bench_sandbox(reps, concurrency, calls))
    search = bench_search(sizes, queries)
    mcp = bench_mcp(reps, calls)
    out: Path = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(
        json.dumps({**meta, "sandbox": sandbox, "search": search, "mcp": mcp}, indent=2)
    )
    lines = markdown(meta, sandbox, search, mcp)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
