"""``stratagem doctor CONFIG``: check a config against this machine before a run
(:func:`stratagem.doctor.diagnose`); exit 1 with findings (an override ``stratagem train``
refuses is one), 2 when the config or its ``--cfg-options`` cannot be read."""

from __future__ import annotations

import argparse
import os
import sys

from stratagem.config import Config, parse_cfg_options
from stratagem.config.overrides import check_overrides
from stratagem.doctor import diagnose, format_table
from stratagem.doctor.checks import Finding


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument('config', help='config file (.py, .json, .yaml)')
    parser.add_argument(
        '--nproc',
        type=int,
        default=int(os.environ.get('WORLD_SIZE', 1)),
        help='processes the run will use (default: $WORLD_SIZE or 1); with --nnodes, '
        "per node, as stratagem train's --nproc",
    )
    parser.add_argument(
        '--nnodes',
        type=int,
        default=1,
        help="nodes the run will use, as stratagem train's --nnodes: the world size is "
        '--nproc x --nnodes (default 1)',
    )
    parser.add_argument(
        '--cfg-options',
        nargs='+',
        default=[],
        metavar='KEY=VALUE',
        help='override config keys, checked and applied as stratagem train does',
    )
    parser.add_argument(
        '--device-memory',
        metavar='SIZE',
        help="memory of one device (e.g. '16GiB', '80GB', bytes): a config whose estimated "
        'peak per device exceeds it is a finding',
    )
    parser.add_argument(
        '--no-disk-probe',
        action='store_true',
        help='do not time a 32 MiB write to estimate the save stall',
    )


def run(args: argparse.Namespace) -> int:
    for flag, value in (('--nproc', args.nproc), ('--nnodes', args.nnodes)):
        if value < 1:
            print(f'stratagem doctor: {flag} must be >= 1, got {value}', file=sys.stderr)
            return 2
    world = args.nproc * args.nnodes
    from stratagem.doctor.memory import parse_size

    try:
        device_memory = None if args.device_memory is None else parse_size(args.device_memory)
    except ValueError as err:
        print(f'stratagem doctor: {err}', file=sys.stderr)
        return 2
    try:
        cfg = Config.fromfile(args.config)
    except Exception as err:  # noqa: BLE001 - reported as the one finding that stops us
        print(f'stratagem doctor: cannot read {args.config}: {err}', file=sys.stderr)
        return 2
    # an override stratagem train refuses is a finding; the others are applied
    refused: list[Finding] = []
    if args.cfg_options:
        try:
            options = parse_cfg_options(args.cfg_options)
            for key, value in list(options.items()):
                try:
                    check_overrides(cfg, {key: value})  # as stratagem train checks them
                except ValueError as err:
                    del options[key]
                    refused.append(
                        Finding(key, str(err), 'stratagem train refuses it: use the key meant')
                    )
            cfg.merge_from_dict(options)
        except ValueError as err:
            print(f'stratagem doctor: --cfg-options: {err}', file=sys.stderr)
            return 2
    options = cfg.to_dict()
    if not options.get('work_dir') and not dict(options.get('strategy') or {}).get('work_dir'):
        # as stratagem train names it: out_dir/<this name> is where checkpoints go
        options['work_dir'] = os.path.join(
            'work_dirs', os.path.splitext(os.path.basename(args.config))[0]
        )
    findings, notes = diagnose(
        options,
        world,
        probe_disk=not args.no_disk_probe,
        device_memory=device_memory,
    )
    findings = refused + findings
    print(f'stratagem doctor: {args.config} on {world} process(es)')
    for note in notes:
        print(f'  - {note}')
    if not findings:
        print('no findings: the config looks ready to run')
        return 0
    print(f'\n{len(findings)} finding(s):\n')
    print(format_table(findings))
    return 1
