"""``clusterwatch demo``: detection and recovery end to end, on this machine.

A coordinator, two agents with simulated GPUs (two "nodes") and, per node,
``torchrun --nnodes 1:2 --nproc-per-node 2`` training a small DDP model over
gloo with periodic checkpoints. Faults are injected on schedule (``--inject``;
by default a straggler, then a hang). The coordinator detects each, names
the rank, node and cause, and recovers: the straggler's node is checkpointed
and left out of the elastic job, the hung job is restarted from its last
complete checkpoint. A live timeline is printed, then a summary; exit 0
once training completes. With ``--no-train``: the coordinator and agents
only, until Ctrl-C or ``--duration-s``. With ``--hardware-series agents`` the
coordinator runs in the large-cluster mode (report digests, no per-GPU
series on its /metrics) and each agent serves its node's /metrics. With
``--coordinators 2`` an etcd (Debian's ``etcd-server``) and two coordinators
share the work; the job's owner is killed (SIGKILL) once the first fault is
recovered, and the other one continues the job and recovers the hang.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from clusterwatch.cli import demo_faults, demo_training
from clusterwatch.cli.common import add_old_flag
from clusterwatch.cli.demo_timeline import FaultOutcome, Timeline
from clusterwatch.client import ClusterClient
from clusterwatch.config import HARDWARE_SERIES
from clusterwatch.runtime.etcd_server import EtcdServer
from clusterwatch.wire.placement import job_owner

DEMO_NODES = ("demo-node-0", "demo-node-1")
RANKS_PER_NODE = 2
JOB = "demo-train"
START_TIMEOUT_S = 30.0
STOP_GRACE_S = 5.0
POLL_S = 0.25
# After the job ends: the coordinator learns of the last steps within a report or two.
SETTLE_S = 2.0
# With several coordinators: the job's owner is killed once the first fault is recovered, or this long
# into training when none is.
KILL_OWNER_AFTER_S = 40.0
# Recovery tuned for a demo that lasts a minute (production defaults are minutes).
DEMO_RECOVERY = ("--straggler-persist-s", "2", "--cooldown-s", "0", "--restart-grace-s", "2")
# Elastic rendezvous through a store the demo hosts, so either node may go; a node gone for 2 s
# is forgotten (torchrun's default: 15 s) and the job re-forms 1 s after the first node is back.
RDZV_CONF = "is_host=false,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=2"


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "demo",
        help="detection and recovery end to end: two simulated-GPU nodes, an elastic torchrun job, injected faults",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
    )
    parser.add_argument(
        "--listen",
        default="127.0.0.1:50051",
        metavar="HOST:PORT",
        help="the (first) coordinator's gRPC address (default 127.0.0.1:50051; port 0: any free port)",
    )
    parser.add_argument(
        "--metrics-listen",
        default="127.0.0.1:9470",
        metavar="HOST:PORT",
        help="its /metrics address (default 127.0.0.1:9470; port 0: any)",
    )
    parser.add_argument("--sim-gpus", type=int, default=4, help="simulated GPUs per node (default: 4)")
    parser.add_argument(
        "--interval-s", type=float, default=0.5, help="report interval in seconds (default: 0.5)"
    )
    parser.add_argument("--duration-s", type=float, default=None, help="stop after this many seconds")
    # The former spellings: ports on loopback, and seconds without their unit.
    add_old_flag(parser, "--grpc-port", "--listen", dest="listen", type=_loopback)
    add_old_flag(parser, "--metrics-port", "--metrics-listen", dest="metrics_listen", type=_loopback)
    add_old_flag(parser, "--interval", "--interval-s", dest="interval_s", type=float)
    add_old_flag(parser, "--duration", "--duration-s", dest="duration_s", type=float)
    parser.add_argument(
        "--state-dir", type=Path, default=None, help="coordinator state (default: a temp dir)"
    )
    parser.add_argument(
        "--train",
        action=argparse.BooleanOptionalAction,
        default=importlib.util.find_spec("torch") is not None,
        help="run the training job with faults (default: when torch is installed)",
    )
    parser.add_argument(
        "--inject",
        action="append",
        metavar="KIND@step=N,rank=R[,factor=F]",
        help="a fault to inject: straggler or hang, at a step, on a rank of the first launch (repeatable; "
        f"default: {' '.join(demo_faults.DEFAULT_FAULTS)}; 'none' for none)",
    )
    parser.add_argument("--steps", type=int, default=150, help="steps the job trains (default: 150)")
    parser.add_argument("--summary-json", type=Path, help="also write the summary to this file")
    parser.add_argument(
        "--hardware-series",
        choices=HARDWARE_SERIES,
        default=HARDWARE_SERIES[0],
        help="who exports per-GPU series: the coordinator (default) or the agents, each on its own "
        "/metrics (the large-cluster mode, coordinator.hardware_series)",
    )
    parser.add_argument(
        "--coordinators",
        type=int,
        choices=(1, 2, 3),
        default=1,
        help="coordinators (more than one: a group on an etcd the demo starts; the job's owner is killed "
        "midway and another continues)",
    )
    parser.add_argument(
        "--top",
        action="store_true",
        help="watch it live in clusterwatch top; the timeline and summary are printed when top quits",
    )
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    specs = args.inject or list(demo_faults.DEFAULT_FAULTS)
    faults = [
        demo_faults.parse_fault(spec, len(DEMO_NODES), RANKS_PER_NODE) for spec in specs if spec != "none"
    ]
    processes: list[subprocess.Popen[bytes]] = []
    jobs: list[subprocess.Popen[bytes]] = []
    etcd: list[EtcdServer] = []
    with tempfile.TemporaryDirectory(prefix="clusterwatch-demo-") as tmp:
        workdir = Path(tmp)
        # The timeline tells the story: the services log only errors unless asked for more.
        child_log = "error" if args.log_level == "info" else args.log_level
        try:
            ports = _start_cluster(args, workdir, child_log, processes, etcd)
            group = [
                Member(f"c{i}", p["grpc_port"], p["metrics_port"], processes[i]) for i, p in enumerate(ports)
            ]
            address, metrics_url = group[0].address, group[0].metrics_url
            agent_urls = (
                _agent_metrics_urls(processes[len(group) :]) if args.hardware_series == "agents" else []
            )

            def demo() -> int:
                _print_banner(args, address, metrics_url, faults, agent_urls)
                if not args.train:
                    return _idle(processes, args.duration_s)
                return _train(args, workdir, group, faults, (processes, jobs))

            return _under_top(address, demo, workdir / "demo.log") if args.top else demo()
        except KeyboardInterrupt:
            print("clusterwatch demo: interrupted")
            return 130
        except RuntimeError as exc:
            print(f"clusterwatch demo: {exc}", file=sys.stderr)
            return 1
        finally:
            with contextlib.suppress(KeyboardInterrupt):
                _stop(processes, jobs)
                for server in etcd:
                    server.stop()


def _loopback(port: str) -> str:
    """An old ``--grpc-port N`` as the address it meant."""
    return f"127.0.0.1:{int(port)}"


def _under_top(address: str, demo: Callable[[], int], log_path: Path) -> int:
    """Run the demo in a thread, its timeline into ``log_path``, and clusterwatch top on it
    in the terminal; when top quits, print the timeline (the demo stops with top)."""
    from clusterwatch.tui.app import TopApp  # Textual loads only for --top

    outcome: list[int] = []
    terminal = sys.stdout  # redirect_stdout below swaps sys.stdout for every thread

    def in_background() -> None:
        with log_path.open("w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            try:
                outcome.append(demo())
            except RuntimeError as exc:  # the services stopped under it when top quit early
                print(f"clusterwatch demo: {exc}")
                outcome.append(1)

    thread = threading.Thread(target=in_background, name="clusterwatch-demo", daemon=True)
    thread.start()
    TopApp(address).run()
    finished = not thread.is_alive()
    for log in (log_path.with_name("services.log"), log_path):
        print(log.read_text() if log.exists() else "", end="", file=terminal)
    if not finished:
        print("clusterwatch demo: stopped with top, before it finished", file=terminal)
    return outcome[0] if finished and outcome else 0


def _start_cluster(
    args: argparse.Namespace,
    workdir: Path,
    log_level: str,
    processes: list[subprocess.Popen[bytes]],
    etcd: list[EtcdServer],
) -> list[dict[str, int]]:
    """The coordinators (with an etcd when several) and the agents; each coordinator's ports. Under
    --top the terminal is top's: the services' logs go to services.log, printed when top quits."""
    errors = (workdir / "services.log").open("wb") if args.top else None
    group: list[str] = []
    if args.coordinators > 1:
        etcd.append(_start_etcd(workdir))
        group = ["--etcd", etcd[0].endpoint, "--advertise", "127.0.0.1:0"]
    ports = []
    for index in range(args.coordinators):
        ready_file = workdir / f"coordinator-{index}.ready"
        coordinator = _start(
            [
                "coordinator",
                "--insecure",
                "--listen",
                args.listen if index == 0 else "127.0.0.1:0",
                "--metrics-listen",
                args.metrics_listen if index == 0 else "127.0.0.1:0",
                "--state-dir",
                str((args.state_dir or workdir / "state") / (f"c{index}" if group else "")),
                "--ready-file",
                str(ready_file),
                "--hardware-series",
                args.hardware_series,
                *DEMO_RECOVERY,
                *(["--shard-id", f"c{index}", *group] if group else []),
            ],
            log_level,
            errors,
        )
        processes.append(coordinator)
        ports.append(_wait_ready(ready_file, coordinator))
    coordinators = ",".join(f"127.0.0.1:{p['grpc_port']}" for p in ports)
    for node in DEMO_NODES:
        processes.append(
            _start(
                [
                    "agent",
                    "--insecure",
                    "--coordinator",
                    coordinators,
                    "--node-id",
                    node,
                    "--gpu-backend",
                    "sim",
                    "--sim-gpus",
                    str(args.sim_gpus),
                    "--interval-s",
                    str(args.interval_s),
                    "--socket",
                    str(workdir / f"{node}.sock"),
                    # Any free port: the banner says which (agents mode; empty: off).
                    "--metrics-listen",
                    "127.0.0.1:0" if args.hardware_series == "agents" else "",
                    # One host: no network between the agents to probe, and the banner finds each
                    # agent's /metrics as the one port it listens on.
                    "--probe-listen",
                    "",
                ],
                log_level,
                errors,
            )
        )
    return ports


def _start_etcd(workdir: Path) -> EtcdServer:
    binary = shutil.which("etcd")
    if binary is None:
        raise RuntimeError("--coordinators needs etcd: apt-get install etcd-server (./dev does it)")
    return EtcdServer(workdir / "etcd", binary=binary)


def _agent_metrics_urls(agents: list[subprocess.Popen[bytes]]) -> list[str]:
    """Each agent's /metrics URL, once it listens (the agents pick free ports)."""
    import psutil  # the agent's dependency; the demo runs agents

    def port(agent: subprocess.Popen[bytes]) -> int | None:
        listening = [c for c in psutil.Process(agent.pid).net_connections("tcp") if c.status == "LISTEN"]
        return listening[0].laddr.port if listening else None

    deadline = time.monotonic() + START_TIMEOUT_S
    urls: list[str] = []
    for agent in agents:
        while (found := port(agent)) is None:
            if agent.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("an agent did not serve its /metrics")
            time.sleep(0.05)
        urls.append(f"http://127.0.0.1:{found}/metrics")
    return urls


def _print_banner(
    args: argparse.Namespace,
    address: str,
    metrics_url: str,
    faults: list[demo_faults.Fault],
    agent_urls: list[str],
) -> None:
    coordinators = (
        "a coordinator" if args.coordinators == 1 else f"{args.coordinators} coordinators (on etcd)"
    )
    lines = [
        f"clusterwatch demo: {coordinators} and {len(DEMO_NODES)} agents with simulated GPUs are running."
    ]
    if args.train:
        lines.append(
            f"  job {JOB}: torchrun --nnodes 1:2 --nproc-per-node {RANKS_PER_NODE} on each node, {args.steps} steps, "
            f"a checkpoint every {demo_training.CHECKPOINT_EVERY} steps"
        )
        lines.append("  faults:      " + ("; ".join(f.label for f in faults) or "none"))
    lines += [
        f"  API (gRPC):  {address}",
        f"  metrics:     {metrics_url}",
        *([f"  agents:      {' '.join(agent_urls)} (hardware series; agents mode)"] if agent_urls else []),
        f"  try:         clusterwatch status --insecure --coordinator {address}",
        f"               clusterwatch incidents --all --insecure --coordinator {address}",
        f"               clusterwatch topology --insecure --coordinator {address}",
    ]
    if not args.train:
        lines.append(
            "Press Ctrl-C to stop"
            + (f" (stopping by itself after {args.duration_s:g} s)." if args.duration_s else ".")
        )
    print("\n".join(lines), flush=True)


def _idle(processes: list[subprocess.Popen[bytes]], duration_s: float | None) -> int:
    deadline = time.monotonic() + duration_s if duration_s else None
    while deadline is None or time.monotonic() < deadline:
        _check_alive(processes)
        time.sleep(POLL_S)
    print("clusterwatch demo: stopped")
    return 0


@dataclasses.dataclass(frozen=True)
class Member:
    """One of the demo's coordinators."""

    shard_id: str
    grpc_port: int
    metrics_port: int
    process: subprocess.Popen[bytes]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"


def _train(
    args: argparse.Namespace,
    workdir: Path,
    group: list[Member],
    faults: list[demo_faults.Fault],
    children: tuple[list[subprocess.Popen[bytes]], list[subprocess.Popen[bytes]]],
) -> int:
    """Run the job to completion, printing the timeline, then the summary.

    Args:
        group: the coordinators; with several, the job's owner is killed once the first fault is
            recovered (or KILL_OWNER_AFTER_S into training) and the timeline follows the next owner.
        children: the services (checked to stay up) and the list the jobs go in.
    """
    from torch.distributed import TCPStore  # type: ignore[attr-defined]  # not in its __all__

    services, jobs = children
    owner = group[int(job_owner(JOB, [m.shard_id for m in group])[1:])] if len(group) > 1 else group[0]
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    started = time.time()
    jobs.extend(
        _start_training(workdir, node, f"127.0.0.1:{store.port}", args.steps, faults)
        for node in range(len(DEMO_NODES))
    )
    print("timeline (seconds since start):", flush=True)
    deadline = time.monotonic() + args.duration_s if args.duration_s else None
    with contextlib.ExitStack() as clients:
        timeline = Timeline(
            clients.enter_context(ClusterClient(owner.address)),
            JOB,
            workdir / demo_training.EVENTS_FILE,
            started,
        )
        to_kill = owner if len(group) > 1 else None
        while any(job.poll() is None for job in jobs):
            _check_alive(services)
            timeline.poll()
            if to_kill is not None and (timeline.resolved() or time.time() - started > KILL_OWNER_AFTER_S):
                owner = _kill_owner(to_kill, group, services, timeline)
                timeline.client = clients.enter_context(ClusterClient(owner.address))
                to_kill = None
            if deadline is not None and time.monotonic() > deadline:
                raise RuntimeError(f"training did not complete within --duration-s {args.duration_s:g} s")
            time.sleep(POLL_S)
        _settle(timeline)
        done = workdir / demo_training.DONE_FILE
        if not done.exists():
            for node in range(len(DEMO_NODES)):
                print(
                    (workdir / f"train-node-{node}.log").read_text(errors="replace")[-3000:], file=sys.stderr
                )
            raise RuntimeError("the training job ended without completing its steps (its logs are above)")
        summary = _summary(
            timeline, json.loads(done.read_text()), _ettr(owner.metrics_url), time.time() - started
        )
    _print_summary(summary)
    if args.summary_json:
        args.summary_json.write_text(json.dumps(summary, indent=2))
    del store
    return 0


def _kill_owner(
    owner: Member, group: list[Member], services: list[subprocess.Popen[bytes]], timeline: Timeline
) -> Member:
    """SIGKILL the job's owner; the coordinator that owns the job next."""
    owner.process.kill()
    owner.process.wait()
    services.remove(owner.process)
    rest = [m for m in group if m is not owner]
    heir = next(m for m in rest if m.shard_id == job_owner(JOB, [r.shard_id for r in rest]))
    timeline.note(
        f"killed    coordinator {owner.shard_id} (SIGKILL), owner of job {JOB}; {heir.shard_id} continues it "
        "once the lease runs out (5 s)"
    )
    return heir


def _settle(timeline: Timeline) -> None:
    """A last look: the coordinator may learn of the final steps a report after the job ended."""
    deadline = time.monotonic() + SETTLE_S
    while time.monotonic() < deadline:
        timeline.poll()
        time.sleep(POLL_S)


def _start(argv: list[str], log_level: str, errors: IO[bytes] | None = None) -> subprocess.Popen[bytes]:
    """A clusterwatch service; its log to ``errors`` (default: this terminal)."""
    return subprocess.Popen(
        [sys.executable, "-m", "clusterwatch", *argv, "--log-level", log_level], stderr=errors
    )


def _start_training(
    workdir: Path, node: int, rendezvous: str, steps: int, faults: list[demo_faults.Fault]
) -> subprocess.Popen[bytes]:
    """One node's torchrun (elastic, 1 to 2 nodes), hooked to that node's agent; output to train-node-N.log."""
    socket = workdir / f"{DEMO_NODES[node]}.sock"
    deadline = time.monotonic() + START_TIMEOUT_S
    while not socket.exists() and time.monotonic() < deadline:  # else the hooks start unconnected
        time.sleep(0.05)
    env = {
        **os.environ,
        "CLUSTERWATCH_AGENT_SOCKET": str(socket),
        "OMP_NUM_THREADS": "1",
        "CLUSTERWATCH_JOB": JOB,
        demo_training.NODE_ENV: str(node),
        demo_training.DIR_ENV: str(workdir),
        demo_training.STEPS_ENV: str(steps),
        demo_faults.ENV: demo_faults.to_json(faults),
        # torch 2.13 + gloo: without it the first group torchrun restarts fails to connect (docs/recovery.md).
        "TORCH_GLOO_LAZY_INIT": "1",
    }
    with (workdir / f"train-node-{node}.log").open("wb") as log:  # the child keeps its own copy
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=1:2",
                f"--nproc-per-node={RANKS_PER_NODE}",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint={rendezvous}",
                f"--rdzv-id={JOB}",
                f"--rdzv-conf={RDZV_CONF}",
                "--max-restarts=3",
                "--module",
                "clusterwatch.cli.demo_training",
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _ettr(metrics_url: str) -> float | None:
    prefix = f'clusterwatch_job_effective_training_time_ratio{{training_job="{JOB}"}} '
    with urllib.request.urlopen(metrics_url, timeout=10) as response:  # noqa: S310 - our http:// URL
        for line in response.read().decode().splitlines():
            if line.startswith(prefix):
                return float(line.removeprefix(prefix))
    return None


def _summary(timeline: Timeline, done: dict[str, int], ettr: float | None, wall_s: float) -> dict[str, Any]:
    delays = timeline.checkpoint_delays()
    return {
        "steps": done["steps"],
        "final_world_size": done["world_size"],
        "wall_seconds": wall_s,
        "effective_training_time_ratio": ettr,
        "faults": [vars(outcome) for outcome in timeline.outcomes()],
        "coordinated_checkpoint_delay_steps": max(
            (d["save_s"] / d["step_s"] for d in delays if d["step_s"]), default=None
        ),
    }


def _print_summary(summary: dict[str, Any]) -> None:
    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f} s"

    print(
        f"\nsummary: {summary['steps']} steps trained in {summary['wall_seconds']:.0f} s, "
        f"finishing on {summary['final_world_size']} ranks"
    )
    print(
        f"  {'fault':42} {'detected after':>14} {'cause':>10} {'recovered in':>13} {'onset->resumed':>15} {'steps lost':>10}  action"
    )
    for fault in (FaultOutcome(**f) for f in summary["faults"]):
        print(
            f"  {fault.label:42} {seconds(fault.detection_s):>14} {fault.cause or '-':>10} {seconds(fault.recovery_s):>13} "
            f"{seconds(fault.onset_to_resumed_s):>15} {'-' if fault.steps_lost is None else fault.steps_lost:>10}  "
            f"{fault.action or '-'}"
        )
    ettr = summary["effective_training_time_ratio"]
    print(f"  effective training time ratio (ETTR): {'-' if ettr is None else f'{ettr:.2f}'}")
    delay = summary["coordinated_checkpoint_delay_steps"]
    if delay is not None:
        print(
            f"  a coordinated checkpoint delayed the job by {delay:.2f} steps (slowest rank's save / step time)"
        )


def _check_alive(processes: list[subprocess.Popen[bytes]]) -> None:
    for p in processes:
        if p.poll() is not None:
            raise RuntimeError(f"a clusterwatch service (pid {p.pid}) exited with code {p.returncode}")


def _wait_ready(ready_file: Path, process: subprocess.Popen[bytes]) -> dict[str, int]:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if ready_file.exists():
            return json.loads(ready_file.read_text())  # type: ignore[no-any-return]
        if process.poll() is not None:
            raise RuntimeError(f"the coordinator exited with code {process.returncode} during start-up")
        time.sleep(0.05)
    raise RuntimeError(f"the coordinator did not start within {START_TIMEOUT_S:.0f} s")


def _stop(processes: list[subprocess.Popen[bytes]], jobs: list[subprocess.Popen[bytes]]) -> None:
    """The training jobs first (each torchrun with its whole session), then the agents and the coordinator."""
    for job in jobs:
        _kill_session(job, signal.SIGTERM)
    for p in processes:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for p in jobs + processes:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    for job in jobs:
        _kill_session(job, signal.SIGKILL)  # whatever a torchrun left behind


def _kill_session(job: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(job.pid, sig)  # started with start_new_session: its pid is its group's
