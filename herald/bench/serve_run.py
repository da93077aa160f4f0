"""The running side of ``herald bench serve`` (:mod:`herald.bench.serve`): the server it starts
(``herald serve`` in a child process, or in a thread of this one), the records, the load levels
and the throughput points beside them."""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import datetime as _dt
import gc
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from herald.bench.common import append_jsonl
from herald.bench.serve_client import (
    LoadSettings,
    engine_deltas,
    metrics_after,
    run_level,
    server_idle,
    server_metrics,
    summarize,
)
from herald.bench.serve_prompts import Prompt
from herald.bench.serve_report import JSONL_NAME, write_readme
from herald.bench.throughput_records import append_record, log
from herald.config import EngineConfig, OffloadConfig
from herald.server.defaults import FRONT_DEFAULTS

START_TIMEOUT_S = 900.0
"""Seconds the server may take to load its model and start."""


@dataclass
class Plan:
    """What the command line asks for, checked."""

    args: argparse.Namespace
    device: torch.device
    dtype: torch.dtype | None
    mode: str
    offload: OffloadConfig | None
    engine: EngineConfig | None
    """The engine of the server started here (None with ``--url``)."""
    context: int
    """Tokens per request allowed: the model's context, capped by ``--max-seq-len``."""
    prompts: dict[int, list[Prompt]] = field(default_factory=dict)
    source: dict[str, Any] = field(default_factory=dict)
    """Where the prompts come from (:meth:`StdlibPrompts.describe`)."""
    block_size: int = 0
    """The model's block size B."""

    def requests(self, concurrency: int) -> int:
        return self.args.requests or 2 * concurrency


# -- the server ---------------------------------------------------------------------------------


class InProcessServer:
    """The real ``herald serve`` app under uvicorn in a thread of this process (127.0.0.1, a
    port the system picks, bound before the model loads, as ``herald serve``)."""

    def __init__(self, plan: Plan):
        from herald.server.launch import bound_url, build_app, make_server, reserve_port

        assert plan.engine is not None
        self.sock = reserve_port("127.0.0.1", 0)  # as herald serve: a port nobody holds
        a = plan.args
        self.device, self.cap = plan.device, a.gpu_memory_utilization
        try:
            self.app: Any = build_app(a.model, plan.engine, device=plan.device,
                                      dtype=plan.dtype, seed=a.seed,
                                      gpu_memory_utilization=a.gpu_memory_utilization)  # fmt: skip
        except BaseException:
            self.sock.close()
            raise
        limits = dataclasses.replace(FRONT_DEFAULTS, keep_alive_timeout_s=KEEP_ALIVE_S)
        self.server = make_server(self.app, self.sock, limits=limits, log_level="warning")
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )
        self.url = bound_url(self.sock)

    def start(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                self.server.should_exit = True
                raise RuntimeError("the server did not start")
            time.sleep(0.05)
        return self.url

    @property
    def engine(self) -> Any:
        return self.app.state.herald.engine_loop.engine

    def describe(self) -> dict[str, Any]:
        e = self.engine
        return {"max_batch_size": e.max_batch_size, "max_seq_len": e.max_seq_len,
                "max_prefill_tokens": e.max_prefill_tokens, "max_waiting": e.scheduler.max_waiting,
                "block_size": e.config.block_size, "kv_pad": e.engine_config.kv_pad,
                "gpu_memory_utilization": self.cap, "process": "thread"}  # fmt: skip

    def stop(self) -> tuple[Any, Any]:
        """Stop the server (its engine closed); the served model and its config."""
        net, config = self.engine.model, self.engine.config
        self.server.should_exit = True
        self.thread.join(timeout=120)
        self.sock.close()
        # the app holds the engine, and the engine its KV: nothing may keep them alive
        self.app = self.server = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if self.cap is not None:  # the cap holds for the whole process: lifted with the server
            from herald.server.peak import cap_gpu_memory

            cap_gpu_memory(1.0, self.device)
        return net, config


_DTYPE_FLAGS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
KEEP_ALIVE_S = 60.0
"""Idle kept-alive connections of the benchmark's server stay open this long, not ``herald
serve``'s default 5 s: the ``openai`` client (httpx) reuses a pooled connection idle up to 5 s,
so at equal timeouts a request can meet the server closing its connection (a failed request that
is no fault of the engine, and the clients do not retry). A server given by ``--url`` keeps its
own setting."""
_READY = re.compile(r"herald serve ready on (http://\S+?):? ")


def serve_command(plan: Plan) -> list[str]:
    """The ``herald serve`` command line of the plan's server (127.0.0.1, a port the system
    picks), every engine setting spelled out."""
    a, e = plan.args, plan.engine
    assert e is not None
    cmd = [sys.executable, "-m", "herald", "serve", "--model", str(a.model),
           "--device", str(plan.device), "--mode", plan.mode, "--host", "127.0.0.1",
           "--port", "0", "--seed", str(a.seed), "--max-batch-size", str(e.max_batch_size),
           "--max-seq-len", str(e.max_seq_len), "--max-waiting", str(e.max_waiting),
           "--max-prefill-tokens", str(e.max_prefill_tokens),
           "--kv-pad", str(e.kv_pad), "--keep-alive-timeout-s", str(KEEP_ALIVE_S)]  # fmt: skip
    if a.gpu_memory_utilization is not None:
        cmd += ["--gpu-memory-utilization", repr(a.gpu_memory_utilization)]
    if plan.dtype is not None:
        cmd += ["--dtype", _DTYPE_FLAGS[plan.dtype]]
    if plan.offload is not None:
        cmd += ["--kv-budget", repr(plan.offload.kv_budget)]
        for flag, value in (("--cpu-kv-gb", a.cpu_kv_gb), ("--cpu-kv-tokens", a.cpu_kv_tokens)):
            if value is not None:
                cmd += [flag, str(value)]
    return cmd


class ChildServer:
    """``herald serve`` in a process of its own, as a user runs it: its engine thread then
    shares its interpreter with nothing but the server, not with this process's streaming
    clients (with 32 clients in one process the served decode ran ~1.7x slower on the GPU
    machine). Its output goes to ``log_path``; its ready line gives the URL."""

    def __init__(self, plan: Plan, log_path: Path):
        self.plan, self.log_path = plan, log_path
        self.cmd = serve_command(plan)
        self.proc: subprocess.Popen[str] | None = None
        self.url: str | None = None
        self._ready = threading.Event()
        self._tail: collections.deque[str] = collections.deque(maxlen=20)
        self._reader: threading.Thread | None = None

    def start(self) -> str:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            self.cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, bufsize=1,
        )  # fmt: skip
        self._reader = threading.Thread(target=self._drain, name="herald-serve-log", daemon=True)
        self._reader.start()
        self._ready.wait(START_TIMEOUT_S)
        if self.url is None:
            self.stop()
            tail = "".join(self._tail).strip()
            raise RuntimeError(f"the server did not start (its output is in {self.log_path})"
                               + (f":\n{tail}" if tail else ""))  # fmt: skip
        return self.url

    def _drain(self) -> None:
        """Copy the server's output into the log until it exits (its pipe never fills)."""
        assert self.proc is not None and self.proc.stdout is not None
        with self.log_path.open("a") as log_file:
            log_file.write(f"$ {' '.join(self.cmd)}\n")
            for line in self.proc.stdout:
                log_file.write(line)
                log_file.flush()
                self._tail.append(line)
                m = _READY.search(line)
                if m is not None and self.url is None:
                    self.url = m.group(1)
                    self._ready.set()
        self._ready.set()  # exited: start() stops waiting

    def describe(self) -> dict[str, Any]:
        e = self.plan.engine
        assert e is not None
        return {"max_batch_size": e.max_batch_size, "max_seq_len": e.max_seq_len,
                "max_prefill_tokens": e.max_prefill_tokens, "max_waiting": e.max_waiting,
                "block_size": self.plan.block_size, "kv_pad": e.kv_pad,
                "gpu_memory_utilization": self.plan.args.gpu_memory_utilization,
                "process": "child"}  # fmt: skip

    def stop(self) -> None:
        """SIGINT (a graceful shutdown), then SIGKILL if it is still running after 120 s."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._reader is not None:
            self._reader.join(timeout=10)


# -- the levels ---------------------------------------------------------------------------------


class Records:
    """``OUT/serve_bench.jsonl``: the run head before the first record, then one line each."""

    def __init__(self, out: Path):
        self.path, self.started = out / JSONL_NAME, False
        self.run_id = _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%SZ") + f"-{os.getpid()}"

    def add(self, rec: dict[str, Any]) -> None:
        rec = {
            "bench": "serve",
            "run_id": self.run_id,
            "time_utc": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
            **rec,
        }
        if self.started:
            append_record(self.path, rec)
        else:
            append_jsonl(self.path, [rec])
            self.started = True


def _settings(plan: Plan, model_id: str) -> LoadSettings:
    a = plan.args
    return LoadSettings(model_id, a.max_tokens, a.steps or None, a.ignore_eos,
                        a.duration_limit_s, a.api_key)  # fmt: skip


def level_head(plan: Plan, card: dict[str, Any], server: dict[str, Any]) -> dict[str, Any]:
    """The fields every level record of this run shares."""
    a, h = plan.args, card.get("herald", {})
    local = a.url is None
    return {
        "kind": "level", "model": a.model, "served_model": card["id"],
        "mode": h.get("mode", plan.mode), "kv_budget": h.get("kv_budget"),
        "device": plan.device.type if local else None,
        "dtype": str(plan.dtype).removeprefix("torch.") if local else None,
        "url": a.url, "server": server, "max_tokens": a.max_tokens, "steps": a.steps or None,
        "ignore_eos": a.ignore_eos, "duration_limit_s": a.duration_limit_s,
        "throughput_point": bool(a.throughput_point and local),
    }  # fmt: skip


def served_batch(plan: Plan, concurrency: int) -> int:
    """The batch the served engine decodes at under ``concurrency`` clients: it runs at most
    ``max_batch_size`` rows whatever the concurrency, so a level's throughput point runs there."""
    assert plan.engine is not None
    return min(concurrency, plan.engine.max_batch_size)


def _throughput_command(plan: Plan, prompt_tokens: int) -> str | None:
    """The ``herald bench throughput`` command of the levels at ``prompt_tokens`` (None for a
    server not started here, or one no throughput variant matches)."""
    from herald.bench.serve_point import throughput_command, throughput_variant

    a = plan.args
    variant = throughput_variant(plan.mode, plan.offload)
    if plan.engine is None or variant is None or not a.steps:
        return None
    kv_pad = plan.engine.kv_pad
    budget = plan.offload.kv_budget if plan.offload is not None else None
    return throughput_command(a.model, plan.device.type, variant, budget, prompt_tokens,
                              sorted({served_batch(plan, c) for c in a.concurrency}),
                              a.steps, kv_pad)  # fmt: skip


def run_levels(plan: Plan, url: str, head: dict[str, Any], records: Records) -> int:
    """Every level, one record each as it ends; the number of requests that failed. The
    server's ``/metrics`` is read just before a level and again once the server is idle after it
    (:func:`~herald.bench.serve_client.metrics_after`): the record's engine figures
    (:func:`~herald.bench.serve_client.engine_deltas`) are the increases between the two (None
    where the server has no such counters)."""
    a, failed = plan.args, 0
    settings = _settings(plan, head["served_model"])
    for p in a.prompt_tokens:
        prompts = plan.prompts[p]
        if a.warmup_requests:
            log(f"warm-up: {a.warmup_requests} request(s) of {p} prompt tokens")
            warm = [q.token_ids for q in prompts[: a.warmup_requests]]
            asyncio.run(run_level(url, warm, len(warm), settings))
            server_idle(url)
        for c in a.concurrency:
            level = prompts[: plan.requests(c)]
            log(f"level start: {head['mode']}, {p} prompt tokens, concurrency {c}, "
                f"{len(level)} requests")  # fmt: skip
            before = server_metrics(url)
            outcomes, wall = asyncio.run(run_level(url, [q.token_ids for q in level], c, settings))
            ended = time.perf_counter()
            s = summarize(outcomes, wall, p)
            idle = server_idle(url)
            after = metrics_after(url, before, s["generated_tokens"])
            engine = engine_deltas(before, after, s["generated_tokens"], wall)
            # the engine's idle seconds after the level (waiting for the server to go idle and
            # for the last scrape) are not the level's
            engine["after_level_s"] = time.perf_counter() - ended
            rec = {**head, "prompt_tokens": p, "context": p + a.max_tokens, "concurrency": c,
                   "requests": len(level), **s, **engine, "server_idle_after": idle,
                   "load_avg_1min": os.getloadavg()[0],
                   "prompts": {**plan.source, "files": [q.files for q in level]},
                   "throughput_command": _throughput_command(plan, p)}  # fmt: skip
            records.add(rec)
            write_readme(a.out)  # also when a later level is cut short
            failed += s["failed"]
            log(f"level done: {s['completed']} completed, {s['failed']} failed, "
                f"{s['cancelled']} cancelled in {wall:.2f} s; "
                f"{s['generated_tokens_per_s'] or 0:.1f} generated tok/s "
                f"({engine['served_tokens_per_s'] or 0:.1f} without the engine's "
                f"{engine['engine_prefill_s'] or 0:.2f} s of prefill), "
                f"{s['prompt_tokens_per_s'] or 0:.1f} prompt tok/s")  # fmt: skip
    return failed


def load_served_model(plan: Plan) -> tuple[Any, Any]:
    """The served model and its config, built in this process for the throughput points when
    the server ran in a child process (a preset's random weights come from ``--seed``, so they
    are the served ones), with the positions the server had."""
    from herald.models.loader import load_model

    a = plan.args
    net, config, _ = load_model(a.model, device=plan.device, dtype=plan.dtype,
                                random_init_seed=a.seed)  # fmt: skip
    net.ensure_max_positions(plan.context)
    return net, config


def run_points(plan: Plan, net: Any, config: Any, head: dict[str, Any], records: Records) -> None:
    """``herald bench throughput``'s point of each level, on the served model."""
    from herald.bench.serve_point import ServedPoints, throughput_variant

    a = plan.args
    variant = throughput_variant(plan.mode, plan.offload)
    if variant is None or plan.engine is None:
        log("throughput points: no throughput variant has the served engine's settings")
        return
    pairs = [(p, c) for p in a.prompt_tokens for c in a.concurrency]
    sizes = [(p, served_batch(plan, c)) for p, c in pairs]
    points = ServedPoints(net, config, plan.device, plan.engine, variant, a.steps, sizes)
    try:
        for (p, c), (_, b) in zip(pairs, sizes, strict=True):
            log(f"throughput point: {variant}, context {p}, batch {b}, steps {a.steps}")
            m = points.measure(p, b)
            records.add({"kind": "throughput_point", "model": a.model, "mode": plan.mode,
                         "kv_budget": head["kv_budget"], "dtype": head["dtype"],
                         "variant": variant, "prompt_tokens": p, "concurrency": c, "batch": b,
                         "steps": a.steps, "command": _throughput_command(plan, p),
                         **m})  # fmt: skip
            write_readme(a.out)
            tp = m["decode_tokens_per_s"]
            log(f"throughput point done: {m['status']}" + (f", {tp:.1f} tok/s" if tp else ""))
    finally:
        points.close()
