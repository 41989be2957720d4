# `shardwise lighthouse`: torchft's lighthouse, which forms the quorums of fault_tolerant() groups.
"""The ``lighthouse`` subcommand."""

from __future__ import annotations

import argparse
import signal
import threading

HELP = ("start torchft's lighthouse, which forms a quorum of the live replica groups of "
        "sw.fault_tolerant() for every step (needs pip install 'shardwise[ft]')")


def register(parser: argparse.ArgumentParser) -> None:
    """The port, the smallest quorum, and torchft's timing settings."""
    parser.add_argument("--port", type=int, default=29510,
                        help="the port to listen on (torchft's default: 29510; 0: any free port)")
    parser.add_argument("--host", default="::", help="the address to bind (default: every one)")
    parser.add_argument("--min-replicas", type=int, required=True,
                        help="replica groups a quorum needs")
    parser.add_argument("--join-timeout-ms", type=int, default=60000,
                        help="how long a quorum waits for live groups that have not asked yet")
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=5000,
                        help="silence after which a group counts as lost")
    parser.add_argument("--quorum-tick-ms", type=int, default=100,
                        help="how often a waiting quorum is checked")


def run(args: argparse.Namespace) -> int:
    from shardwise.errors import ArgumentError, FaultToleranceError
    from shardwise.fault_tolerance.transform import EXTRA

    for name in ("min_replicas", "join_timeout_ms", "heartbeat_timeout_ms", "quorum_tick_ms"):
        if getattr(args, name) < 1:
            raise ArgumentError(f"--{name.replace('_', '-')} {getattr(args, name)}: accepted: "
                                "an integer >= 1")
    if not 0 <= args.port < 65536:
        raise ArgumentError(f"--port {args.port}: accepted: 0 .. 65535")
    try:
        from torchft._torchft import LighthouseServer
    except ImportError as exc:
        raise FaultToleranceError(f"the lighthouse is torchft's ({exc}); {EXTRA}") from None
    host = f"[{args.host}]" if ":" in args.host else args.host
    server = LighthouseServer(bind=f"{host}:{args.port}", min_replicas=args.min_replicas,
                              join_timeout_ms=args.join_timeout_ms,
                              quorum_tick_ms=args.quorum_tick_ms,
                              heartbeat_timeout_ms=args.heartbeat_timeout_ms)
    print(f"lighthouse at {server.address()} (min replicas {args.min_replicas}); set "
          f"TORCHFT_LIGHTHOUSE={server.address()} for every replica group", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.shutdown()
    return 0
