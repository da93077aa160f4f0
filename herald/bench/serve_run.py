"""The running side of ``herald bench serve`` (:mod:`herald.bench.serve`): the server started
in this process, the records, the load levels and the throughput points beside them."""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import gc
import os
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
        try:
            self.app: Any = build_app(a.model, plan.engine, device=plan.device,
                                      dtype=plan.dtype, seed=a.seed)  # fmt: skip
        except BaseException:
            self.sock.close()
            raise
        self.server = make_server(self.app, self.sock, log_level="warning")
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
                "block_size": e.config.block_size, "kv_pad": e.engine_config.kv_pad}  # fmt: skip

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
        return net, config


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
    }  # fmt: skip


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
                              list(a.concurrency), a.steps, kv_pad)  # fmt: skip


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


def run_points(plan: Plan, net: Any, config: Any, head: dict[str, Any], records: Records) -> None:
    """``herald bench throughput``'s point of each level, on the served model."""
    from herald.bench.serve_point import ServedPoints, throughput_variant

    a = plan.args
    variant = throughput_variant(plan.mode, plan.offload)
    if variant is None or plan.engine is None:
        log("throughput points: no throughput variant has the served engine's settings")
        return
    pairs = [(p, c) for p in a.prompt_tokens for c in a.concurrency]
    points = ServedPoints(net, config, plan.device, plan.engine, variant, a.steps, pairs)
    try:
        for p, c in pairs:
            log(f"throughput point: {variant}, context {p}, batch {c}, steps {a.steps}")
            m = points.measure(p, c)
            records.add({"kind": "throughput_point", "model": a.model, "mode": plan.mode,
                         "kv_budget": head["kv_budget"], "dtype": head["dtype"],
                         "variant": variant, "prompt_tokens": p, "concurrency": c,
                         "steps": a.steps, "command": _throughput_command(plan, p),
                         **m})  # fmt: skip
            write_readme(a.out)
            tp = m["decode_tokens_per_s"]
            log(f"throughput point done: {m['status']}" + (f", {tp:.1f} tok/s" if tp else ""))
    finally:
        points.close()
