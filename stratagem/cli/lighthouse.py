"""``stratagem lighthouse``: torchft's lighthouse, which the replica groups of a
fault-tolerant job (``strategy.fault_tolerance``) join; it forms each step's quorum of the
live groups. Prints its address (the groups' ``--lighthouse``), then serves until Ctrl-C or
SIGTERM."""

from __future__ import annotations

import argparse
import signal
import threading

from stratagem.strategies.replica_groups import LIGHTHOUSE_ENV, require_torchft


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``stratagem lighthouse``."""
    parser.add_argument(
        '--min-replicas',
        type=int,
        default=1,
        metavar='N',
        help='the fewest replica groups a quorum forms with (default 1: one survivor trains '
        'on); a group waits for it up to its fault_tolerance.quorum_timeout',
    )
    parser.add_argument(
        '--join-timeout',
        type=float,
        default=1.0,
        metavar='SECONDS',
        help='how long a quorum waits for a group that is starting (heartbeating, not yet '
        'asking) before it forms without it (default 1)',
    )
    parser.add_argument(
        '--heartbeat-timeout',
        type=float,
        default=5.0,
        metavar='SECONDS',
        help='a group silent this long is dead: left out of the next quorum (default 5)',
    )
    parser.add_argument(
        '--port', type=int, default=29510, help='TCP port to serve on (default 29510; 0: any free)'
    )
    parser.add_argument('--host', default='::', help='address to bind (default every interface)')


def run(args: argparse.Namespace) -> int:
    """Serve until interrupted; exit status 0."""
    if args.min_replicas < 1:
        raise ValueError(f'--min-replicas {args.min_replicas}: give an integer >= 1')
    for name in ('join_timeout', 'heartbeat_timeout'):
        if getattr(args, name) <= 0:
            raise ValueError(f'--{name.replace("_", "-")} {getattr(args, name)}: give seconds > 0')
    if not 0 <= args.port < 65536:
        raise ValueError(f'--port {args.port} is not a TCP port; give 0-65535')
    require_torchft()
    from torchft.coordination import LighthouseServer

    host = f'[{args.host}]' if ':' in args.host else args.host
    try:
        server = LighthouseServer(
            bind=f'{host}:{args.port}',
            min_replicas=args.min_replicas,
            join_timeout_ms=int(args.join_timeout * 1000),
            heartbeat_timeout_ms=int(args.heartbeat_timeout * 1000),
        )
    except RuntimeError as err:
        raise RuntimeError(
            f'stratagem lighthouse: cannot serve on {host}:{args.port} ({err}); is another '
            'lighthouse running there? Give another --port (0: any free one)'
        ) from err
    address = server.address()
    print(f'lighthouse: {address}', flush=True)
    print(
        f'  min_replicas {args.min_replicas}, join timeout {args.join_timeout:g} s, heartbeat '
        f'timeout {args.heartbeat_timeout:g} s; start each replica group with\n'
        f'  stratagem train CONFIG --nproc K --replica-id I --lighthouse {address}\n'
        f'  (or export {LIGHTHOUSE_ENV}={address})',
        flush=True,
    )
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        server.shutdown()
    print('lighthouse: stopped', flush=True)
    return 0
