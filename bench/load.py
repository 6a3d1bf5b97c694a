"""Cluster-scale load: thousands of simulated agents at 1 Hz against one coordinator process.

Usage:
    python -m bench.load [--agents 10000] [--seconds 600 | --quick] [--procs 2] [--json PATH]

A real `clusterwatch coordinator` (plaintext on loopback, temporary state
directory) gets --agents Connect streams from --procs generator processes
(bench/load_agents.py), each agent sending one report every 1/--rate s with
--gpus GPUs and --ranks training ranks (--steps finished steps each), at most
--window reports ahead of the coordinator's acks. After --warmup-s the
script measures for --seconds:

* reports applied per second, from the coordinator's own counters
  (the sum of NodeStatus.reports_received_total in its snapshots);
* coordinator CPU (cores, and µs per applied report) and RSS at the end of
  the warm-up and at the end (growth %), from /proc via psutil;
* send-to-visible latency through the API: every --probe-period-s one of
  --probes probe agents sends a report and GetSnapshot(summary_only) is
  polled back to back until it shows (bench/load_probes.py; the same polls
  also give the age of every node's newest report);
* `/metrics` scrape time and size, one scrape every --scrape-interval-s
  (gzip, as Prometheus asks);
* the generator's own CPU, reports it skipped (window full: the coordinator
  is behind; or it lagged its own schedule), streams the coordinator closed
  (the agents reconnect with the uplink's backoff).

With --hardware-series agents the coordinator runs with
coordinator.hardware_series = "agents" and every simulated agent sends report
digests (clusterwatch/wire/report_digest.py), as real agents do when asked.

Every figure comes with what it cost to observe: each snapshot poll and each
scrape is work on the coordinator, as it is for a real `clusterwatch top` or
Prometheus.

--py-spy-out records a py-spy profile of the coordinator during the first
--py-spy-s of the measurement (.svg flame graph, .txt collapsed stacks).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import multiprocessing
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import grpc
import psutil

from bench.coordinator_process import start_coordinator, stop_coordinator
from bench.load_agents import WorkerSpec, worker_main
from bench.load_probes import ProbeAgents, Prober, Sampler, Scraper, cpu_s, percentile
from clusterwatch.config import HARDWARE_SERIES
from clusterwatch.runtime.grpc_options import CHANNEL_OPTIONS
from clusterwatch.v1 import cluster_pb2, cluster_pb2_grpc


@dataclasses.dataclass(frozen=True)
class Coordinator:
    pid: int
    grpc_port: int
    metrics_port: int
    # Where status, incidents and the probers call: ClusterService's own port, or the agents' (--api main).
    api_port: int
    log: Path


@contextlib.contextmanager
def coordinator_process(
    state_dir: Path, log_level: str = "warning", hardware_series: str = "coordinator", api: str = "thread"
) -> Iterator[Coordinator]:
    """A `clusterwatch coordinator` on loopback ports, state and log (at ``log_level``) in ``state_dir``;
    with ``api`` "thread", ClusterService also on a port of its own (coordinator.api_listen)."""
    log = state_dir / "coordinator.log"
    api_listen = ("--api-listen", "127.0.0.1:0") if api == "thread" else ()
    started = start_coordinator(
        state_dir, "--hardware-series", hardware_series, *api_listen, log_level=log_level, log=log
    )
    try:
        assert started.metrics_port is not None
        api_port = started.api_port if api == "thread" else started.grpc_port
        assert api_port is not None
        yield Coordinator(started.process.pid, started.grpc_port, started.metrics_port, api_port, log)
    finally:
        stop_coordinator(started.process)


class Stats(threading.Thread):
    """The latest counters of every generator process."""

    def __init__(self, results: Any, workers: int) -> None:
        super().__init__(name="stats", daemon=True)
        self._results = results
        self.latest: dict[int, dict[str, Any]] = {}
        self.ready = 0
        self.done = 0
        self._workers = workers

    def run(self) -> None:
        while self.done < self._workers:
            try:
                message = self._results.get(timeout=1.0)
            except queue.Empty:
                continue
            if message.get("ready"):
                self.ready += 1
                continue
            self.latest[message["worker"]] = message
            if message.get("done"):
                self.done += 1

    def total(self) -> dict[str, float]:
        keys = (
            "sent",
            "skipped_window",
            "skipped_late",
            "late",
            "acks",
            "commands",
            "streams_opened",
            "streams_closed",
            "refused",
            "skipped_not_admitted",
            "reconnects",
            "pending_bytes",
            "sent_bytes",
        )
        out: dict[str, float] = {k: sum(s[k] for s in self.latest.values()) for k in keys}
        out["unacked_now_max"] = max((s["unacked_now_max"] for s in self.latest.values()), default=0)
        out["max_lateness_s"] = max((s["max_lateness_s"] for s in self.latest.values()), default=0.0)
        return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--agents", type=int, default=10_000)
    parser.add_argument("--seconds", type=float, default=600.0, help="measurement window after the warm-up")
    parser.add_argument("--quick", action="store_true", help="--seconds 60")
    parser.add_argument("--warmup-s", type=float, default=60.0, help="ramp plus settling before measuring")
    parser.add_argument("--ramp-s", type=float, default=20.0, help="streams open evenly over this long")
    parser.add_argument("--rate", type=float, default=1.0, help="reports/s per agent")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--ranks", type=int, default=8, help="training ranks per node (0: none)")
    parser.add_argument("--steps", type=int, default=1, help="finished steps per rank per report")
    parser.add_argument("--job-nodes", type=int, default=128, help="nodes per job (8 ranks each by default)")
    parser.add_argument("--window", type=int, default=10, help="unacknowledged reports before an agent skips")
    parser.add_argument("--procs", type=int, default=2, help="load-generator processes")
    parser.add_argument("--streams-per-connection", type=int, default=100)
    parser.add_argument("--tick-s", type=float, default=0.01, help="generator scheduler period")
    parser.add_argument("--probes", type=int, default=4, help="probe agents (in this process)")
    parser.add_argument(
        "--probe-period-s",
        type=float,
        default=2.0,
        help="one probe report (and its snapshot polls) per this long",
    )
    parser.add_argument("--scrape-interval-s", type=float, default=15.0)
    parser.add_argument(
        "--py-spy-out", type=Path, help="profile the coordinator into this file (.svg or .txt)"
    )
    parser.add_argument("--py-spy-s", type=float, default=20.0)
    parser.add_argument(
        "--hardware-series",
        choices=HARDWARE_SERIES,
        default=HARDWARE_SERIES[0],
        help="the coordinator's mode; with agents, the simulated agents send report digests",
    )
    parser.add_argument(
        "--api",
        choices=("thread", "main"),
        default="thread",
        help="where the probers call ClusterService: its own thread and port (coordinator.api_listen), "
        "or the agents' server on the core's loop",
    )
    parser.add_argument("--json", type=Path, help="write the results here as JSON")
    parser.add_argument("--coordinator-log", type=Path, help="keep the coordinator's log here")
    parser.add_argument(
        "--coordinator-log-level", default="warning", choices=("debug", "info", "warning", "error")
    )
    args = parser.parse_args()
    if args.quick:
        args.seconds = 60.0
    with tempfile.TemporaryDirectory(prefix="clusterwatch-load-") as tmp:
        try:
            with coordinator_process(
                Path(tmp), args.coordinator_log_level, args.hardware_series, args.api
            ) as coord:
                result = run(args, coord)
        finally:
            if args.coordinator_log:
                shutil.copyfile(Path(tmp) / "coordinator.log", args.coordinator_log)
    print(summary(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def run(args: argparse.Namespace, coord: Coordinator) -> dict[str, Any]:
    context = multiprocessing.get_context("spawn")  # no fork after grpc has started threads
    results: Any = context.Queue()
    controls: list[Any] = []
    workers = []
    for worker in range(args.procs):
        spec = WorkerSpec(
            worker=worker,
            host="127.0.0.1",
            port=coord.grpc_port,
            agents=tuple(range(worker, args.agents, args.procs)),
            total_agents=args.agents,
            gpus=args.gpus,
            ranks=args.ranks,
            steps=args.steps,
            job_nodes=args.job_nodes,
            interval_s=1.0 / args.rate,
            window=args.window,
            streams_per_connection=args.streams_per_connection,
            ramp_s=args.ramp_s,
            tick_s=args.tick_s,
            digest=args.hardware_series == "agents",
        )
        control: Any = context.Queue()
        process = context.Process(
            target=worker_main, args=(spec, control, results), name=f"load-{worker}", daemon=True
        )
        process.start()
        controls.append(control)
        workers.append(process)
    stats = Stats(results, args.procs)
    stats.start()
    setup_started = time.monotonic()
    while stats.ready < args.procs:
        if time.monotonic() - setup_started > 300 or not all(p.is_alive() for p in workers):
            raise SystemExit("load generators did not start")
        time.sleep(0.1)
    setup_s = time.monotonic() - setup_started
    start = time.time() + 2.0
    begin, end = start + args.warmup_s, start + args.warmup_s + args.seconds
    for control in controls:
        control.put(start)
        control.put(end + 1.0)
    stop = threading.Event()
    probes = ProbeAgents(
        "127.0.0.1",
        coord.grpc_port,
        args.probes,
        gpus=args.gpus,
        ranks=args.ranks,
        steps=args.steps,
        interval_s=args.probe_period_s * args.probes,
        digest=args.hardware_series == "agents",
    )
    probes.start()
    prober = Prober(
        f"127.0.0.1:{coord.api_port}",
        probes,
        probe_period_s=args.probe_period_s,
        window=(begin, end),
        stop=stop,
    )
    scraper = Scraper(coord.metrics_port, args.scrape_interval_s, stop, count_after_unix_s=begin)
    sampler = Sampler(coord.pid, stop)
    coordinator = psutil.Process(coord.pid)
    generators = [psutil.Process(p.pid) for p in workers]
    myself = psutil.Process()
    incidents_prober = IncidentsProber(f"127.0.0.1:{coord.api_port}", stop, window=(begin, end))
    for thread in (prober, scraper, sampler, incidents_prober):
        thread.start()
    load_before = os.getloadavg()

    def reading() -> dict[str, Any]:
        return {
            "unix_s": time.time(),
            "coordinator_cpu_s": cpu_s(coordinator),
            "coordinator_rss_bytes": coordinator.memory_info().rss,
            "generator_cpu_s": sum(cpu_s(p) for p in generators),
            "prober_cpu_s": cpu_s(myself),
            "generator": stats.total(),
        }

    time.sleep(max(0.0, begin - time.time()))
    profile = None
    if args.py_spy_out:
        raw = ["--format", "raw"] if args.py_spy_out.suffix == ".txt" else []
        profile = subprocess.Popen(
            [
                str(Path(sys.executable).parent / "py-spy"),
                "record",
                "--pid",
                str(coord.pid),
                "-d",
                str(int(args.py_spy_s)),
                "-o",
                str(args.py_spy_out),
                "--nonblocking",
                *raw,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    first = reading()
    time.sleep(max(0.0, end - time.time()))
    last = reading()
    outcome = verdicts(f"127.0.0.1:{coord.api_port}")
    stop.set()
    load_after = os.getloadavg()
    for process in workers:
        process.join(timeout=60)
    stats.join(timeout=5)
    for thread in (prober, scraper, sampler, incidents_prober):
        thread.join(timeout=300)
    probes.close()
    if profile is not None:
        profile.wait(timeout=args.py_spy_s + 60)
    final = stats.total()
    exit_codes = [p.exitcode for p in workers]
    log = coord.log.read_text(errors="replace").splitlines()
    return measure(
        args,
        first=first,
        last=last,
        prober=prober,
        scraper=scraper,
        sampler=sampler,
        final=final,
        window=(begin, end),
    ) | {
        "setup_s": round(setup_s, 1),
        "generator_exit_codes": exit_codes,
        "machine": {"cpus": os.cpu_count(), "loadavg_before": load_before, "loadavg_after": load_after},
        "coordinator_log_lines": len(log),
        "coordinator_log_tail": log[-5:],
        "generator_close_reasons": _merge(w["close_reasons"] for w in stats.latest.values()),
        "generator_closed_stream_ages": _merge(w["closed_stream_ages"] for w in stats.latest.values()),
        "generator_first_closes": sorted(c for w in stats.latest.values() for c in w["first_closes"])[:10],
        "generator_goaways": sum(w["goaways"] for w in stats.latest.values()),
        "verdicts": outcome,
        "list_incidents": {
            "count": len(incidents_prober.seconds),
            "seconds_p50": round(percentile(incidents_prober.seconds, 0.5), 3),
            "seconds_p99": round(percentile(incidents_prober.seconds, 0.99), 3),
            "seconds_max": round(max(incidents_prober.seconds, default=math.nan), 3),
            "errors": incidents_prober.errors[-5:],
        },
    }


class IncidentsProber(threading.Thread):
    """``clusterwatch incidents``' call (ListIncidents) once a second inside the window, timed."""

    def __init__(self, target: str, stop: threading.Event, window: tuple[float, float]) -> None:
        super().__init__(name="incidents-prober", daemon=True)
        self._target, self._stopping, self._window = target, stop, window
        self.seconds: list[float] = []
        self.errors: list[str] = []

    def run(self) -> None:
        begin, end = self._window
        with grpc.insecure_channel(self._target) as channel:
            stub = cluster_pb2_grpc.ClusterServiceStub(channel)
            while not self._stopping.wait(1.0):
                if not begin <= time.time() <= end:
                    continue
                started = time.monotonic()
                try:
                    stub.ListIncidents(cluster_pb2.ListIncidentsRequest(), timeout=60)
                except grpc.RpcError as exc:
                    self.errors.append(f"{exc.code().name}: {exc.details()}")
                    continue
                self.seconds.append(time.monotonic() - started)


def verdicts(target: str) -> dict[str, Any]:
    """What the coordinator concluded over the whole run: incidents opened by kind, actions, reports missed."""
    with grpc.insecure_channel(target, options=CHANNEL_OPTIONS) as channel:
        stub = cluster_pb2_grpc.ClusterServiceStub(channel)
        incidents = stub.ListIncidents(
            cluster_pb2.ListIncidentsRequest(include_resolved=True, limit=10_000), timeout=120
        ).incidents
        actions = stub.ListActions(cluster_pb2.ListActionsRequest(limit=10_000), timeout=120).actions
        snapshot = stub.GetSnapshot(cluster_pb2.GetSnapshotRequest(summary_only=True), timeout=120)
    kinds: dict[str, int] = {}
    for incident in incidents:
        kinds[incident.kind] = kinds.get(incident.kind, 0) + 1
    return {
        "incidents_by_kind": kinds,
        "false_incidents": sum(n for kind, n in kinds.items() if kind != "coordinator_overloaded"),
        "actions": len(actions),
        "reports_missed": sum(n.reports_missed_total for n in snapshot.nodes),
        "nodes_known": len(snapshot.nodes),
        "coordinator_lag_s_at_end": round(snapshot.coordinator.lag_seconds, 3),
        "streams_refused_last_minute_at_end": snapshot.coordinator.streams_refused_last_minute,
    }


def _merge(counters: Iterable[dict[str, int]]) -> dict[str, int]:
    merged: dict[str, int] = {}
    for counter in counters:
        for key, count in counter.items():
            merged[key] = merged.get(key, 0) + count
    return merged


def measure(
    args: argparse.Namespace,
    *,
    first: dict[str, Any],
    last: dict[str, Any],
    prober: Prober,
    scraper: Scraper,
    sampler: Sampler,
    final: dict[str, float],
    window: tuple[float, float],
) -> dict[str, Any]:
    begin, end = window
    wall_s = last["unix_s"] - first["unix_s"]
    inside = [s for s in prober.polls if begin <= s.sent_unix_s and s.received_unix_s <= end]
    applied = rate = math.nan
    if len(inside) >= 2:
        applied = inside[-1].received_total - inside[0].received_total
        rate = applied / (inside[-1].server_unix_s - inside[0].server_unix_s)
    coordinator_cpu_s = last["coordinator_cpu_s"] - first["coordinator_cpu_s"]
    generator_cpu_s = last["generator_cpu_s"] - first["generator_cpu_s"]
    sent = last["generator"]["sent"] - first["generator"]["sent"]
    rss0, rss1 = first["coordinator_rss_bytes"], last["coordinator_rss_bytes"]
    rss_inside = [rss for t, _, rss in sampler.samples if begin <= t <= end]
    # A longer warm-up: growth over the second half of the window only.
    rss_half = next((rss for t, _, rss in sampler.samples if t >= (begin + end) / 2), rss1)
    snapshot_s = [s.received_unix_s - s.sent_unix_s for s in inside]
    scrapes = [s for s in scraper.scrapes if begin <= s.started_unix_s <= end]
    scrape_ok = [s for s in scrapes if s.status == 200]
    samples = next((s.samples for s in scraper.scrapes if s.samples), None)

    def delta(key: str) -> float:
        return float(last["generator"][key] - first["generator"][key])

    return {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "window_s": round(wall_s, 1),
        "target_reports_per_second": args.agents * args.rate,
        "reports_applied": applied,
        "reports_applied_per_second": round(rate, 1),
        "generator": {
            "reports_sent_per_second": round(sent / wall_s, 1),
            "skipped_window_full": delta("skipped_window"),
            "skipped_generator_behind": delta("skipped_late"),
            "sent_late_over_100ms": delta("late"),
            "max_lateness_s": round(final["max_lateness_s"], 3),
            "unacked_max_at_end": last["generator"]["unacked_now_max"],
            "pending_bytes_at_end": last["generator"]["pending_bytes"],
            "streams_opened": final["streams_opened"],
            "streams_closed_by_coordinator": last["generator"]["streams_closed"],
            "refused_streams_per_second": round(delta("refused") / wall_s, 1),
            "skipped_not_admitted": delta("skipped_not_admitted"),
            "reconnects": last["generator"]["reconnects"],
            "commands_received": final["commands"],
            "report_bytes_mean": round(delta("sent_bytes") / sent) if sent else None,
            "cpu_cores": round(generator_cpu_s / wall_s, 3),
            "cpu_us_per_report": round(generator_cpu_s / sent * 1e6, 1) if sent else None,
            "prober_and_scraper_cpu_cores": round((last["prober_cpu_s"] - first["prober_cpu_s"]) / wall_s, 3),
        },
        "agents_connected": inside[-1].nodes_up if inside else None,
        "open_incidents_at_end": inside[-1].incidents if inside else None,
        "coordinator": {
            "cpu_cores": round(coordinator_cpu_s / wall_s, 3),
            "cpu_us_per_report": round(coordinator_cpu_s / applied * 1e6, 1) if applied else None,
            "rss_mb_warmup_end": round(rss0 / 1e6, 1),
            "rss_mb_end": round(rss1 / 1e6, 1),
            "rss_mb_max": round(max(rss_inside, default=rss1) / 1e6, 1),
            "rss_growth_percent": round((rss1 - rss0) / rss0 * 100, 2),
            "rss_mb_half": round(rss_half / 1e6, 1),
            "rss_growth_percent_second_half": round((rss1 - rss_half) / rss_half * 100, 2),
        },
        "latency_s": {
            "probe_count": len(prober.probe_upper_s),
            "probe_lost": prober.probes_lost,
            "probe_upper_p50": round(percentile(prober.probe_upper_s, 0.5), 3),
            "probe_upper_p99": round(percentile(prober.probe_upper_s, 0.99), 3),
            "probe_upper_max": round(max(prober.probe_upper_s, default=math.nan), 3),
            "probe_lower_p50": round(percentile(prober.probe_lower_s, 0.5), 3),
            "probe_lower_p99": round(percentile(prober.probe_lower_s, 0.99), 3),
            "population_count": len(prober.population_upper_s),
            "population_upper_p50": round(percentile(prober.population_upper_s, 0.5), 3),
            "population_upper_p99": round(percentile(prober.population_upper_s, 0.99), 3),
            "population_upper_max": round(max(prober.population_upper_s, default=math.nan), 3),
        },
        "polls": [
            [
                round(p.sent_unix_s - begin, 2),
                round(p.received_unix_s - p.sent_unix_s, 3),
                round(p.server_unix_s - begin, 2),
                p.nodes_up,
                p.received_total,
                p.incidents,
            ]
            for p in prober.polls
        ],  # (sent, seconds, server time: from the window's start; nodes up, reports received, open incidents)
        "coordinator_samples": [
            [round(t - begin, 1), round(cpu, 2), round(rss / 1e6, 1)] for t, cpu, rss in sampler.samples
        ],  # (time from the window's start, CPU s, RSS MB)
        "snapshots": {
            "count": len(inside),
            "seconds_p50": round(percentile(snapshot_s, 0.5), 3),
            "seconds_p99": round(percentile(snapshot_s, 0.99), 3),
            "seconds_max": round(max(snapshot_s, default=math.nan), 3),
            "bytes": inside[-1].bytes if inside else None,
            "errors": prober.errors[-5:],
        },
        "scrapes": {
            "count": len(scrape_ok),
            "failed": len(scrapes) - len(scrape_ok),
            "seconds_p50": round(percentile([s.seconds for s in scrape_ok], 0.5), 3),
            "seconds_p99": round(percentile([s.seconds for s in scrape_ok], 0.99), 3),
            "seconds_max": round(max((s.seconds for s in scrape_ok), default=math.nan), 3),
            "gzip_bytes": scrape_ok[-1].bytes if scrape_ok else None,
            "samples": samples,
            "errors": scraper.errors[-5:],
        },
    }


def summary(r: dict[str, Any]) -> str:
    c, g, lat, snap, scr = r["coordinator"], r["generator"], r["latency_s"], r["snapshots"], r["scrapes"]
    cfg = r["config"]
    lines = [
        f"{cfg['agents']} agents x {cfg['rate']} Hz, {cfg['gpus']} GPUs, {cfg['ranks']} ranks x {cfg['steps']} steps, "
        f"hardware series from the {cfg.get('hardware_series', 'coordinator')}, "
        f"ClusterService on the {cfg.get('api', 'main')} server, "
        f"{cfg['procs']} generator processes; measured {r['window_s']} s after {cfg['warmup_s']} s warm-up "
        f"(load average {r['machine']['loadavg_before'][0]:.1f} -> {r['machine']['loadavg_after'][0]:.1f} "
        f"on {r['machine']['cpus']} CPUs)",
        f"  reports applied/s   {r['reports_applied_per_second']} of {r['target_reports_per_second']:.0f} "
        f"(sent {g['reports_sent_per_second']}/s; nodes up {r['agents_connected']}, open incidents "
        f"{r['open_incidents_at_end']})",
        f"  coordinator         {c['cpu_cores']} cores, {c['cpu_us_per_report']} µs/report; RSS {c['rss_mb_warmup_end']}"
        f" -> {c['rss_mb_end']} MB ({c['rss_growth_percent']:+} %; second half of the window "
        f"{c['rss_growth_percent_second_half']:+} %), max {c['rss_mb_max']} MB",
        f"  send->visible probe p50 {lat['probe_upper_p50']} s, p99 {lat['probe_upper_p99']} s, max "
        f"{lat['probe_upper_max']} s (lower bounds p50 {lat['probe_lower_p50']}, p99 {lat['probe_lower_p99']}; "
        f"{lat['probe_count']} probes, {lat['probe_lost']} lost)",
        f"  age at poll, all    p50 {lat['population_upper_p50']} s, p99 {lat['population_upper_p99']} s, max "
        f"{lat['population_upper_max']} s ({lat['population_count']} reports)",
        f"  snapshot (summary)  p50 {snap['seconds_p50']} s, p99 {snap['seconds_p99']} s, {snap['bytes']} bytes, "
        f"{snap['count']} polls",
        f"  /metrics scrape     p50 {scr['seconds_p50']} s, p99 {scr['seconds_p99']} s, max {scr['seconds_max']} s, "
        f"{scr['gzip_bytes']} bytes gzip, {scr['samples']} samples, {scr['count']} ok / {scr['failed']} failed",
        f"  generator           {g['cpu_cores']} cores, {g['cpu_us_per_report']} µs/report; skipped: window full "
        f"{g['skipped_window_full']:.0f}, generator behind {g['skipped_generator_behind']:.0f}; "
        f"late >100 ms {g['sent_late_over_100ms']:.0f}; streams closed by coordinator "
        f"{g['streams_closed_by_coordinator']:.0f} (reconnects {g['reconnects']:.0f}); commands {g['commands_received']:.0f}",
    ]
    v, li = r["verdicts"], r["list_incidents"]
    lines += [
        f"  refused streams     {g['refused_streams_per_second']}/s in the window (reports not sent while not "
        f"admitted: {g['skipped_not_admitted']:.0f}); ListIncidents p50 {li['seconds_p50']} s, p99 "
        f"{li['seconds_p99']} s, max {li['seconds_max']} s ({li['count']} calls)",
        f"  verdicts (whole run) incidents {v['incidents_by_kind']}, false {v['false_incidents']}, actions "
        f"{v['actions']}, reports missed {v['reports_missed']} of {v['nodes_known']} nodes; lag at end "
        f"{v['coordinator_lag_s_at_end']} s",
    ]
    for key in ("errors",):
        for what in (snap, scr, li):
            lines += [f"  error: {e}" for e in what[key]]
    if r["generator_close_reasons"]:
        lines.append(
            f"  streams ended by the coordinator (whole run, shutdown included): {r['generator_close_reasons']}, "
            f"open for {r['generator_closed_stream_ages']}"
        )
    if r["coordinator_log_lines"]:
        lines.append(f"  coordinator log: {r['coordinator_log_lines']} lines, the last:")
        lines += [f"    {line[:200]}" for line in r["coordinator_log_tail"][-2:]]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
