"""``stratagem convert SRC DST``: :func:`stratagem.checkpoint.convert.convert_checkpoint`
with a progress bar on stderr. SRC: any format ``checkpoint.formats`` detects (a single file,
a sharded DCP directory, a DeepSpeed directory, a Hugging Face directory, a ``.safetensors``
file); ``--to``: ``file``, ``sharded``, ``hf`` or ``safetensors`` (the weights alone)."""

from __future__ import annotations

import argparse
import importlib
import sys

from stratagem.checkpoint.convert import TARGETS, convert_checkpoint

# a source may be a backend's own layout (DeepSpeed's directories): importing
# stratagem.strategies registers those formats with checkpoint.formats.register_format
importlib.import_module('stratagem.strategies')


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        'src',
        help='the checkpoint to convert (a file, a sharded directory, a DeepSpeed (ZeRO) '
        'directory, a Hugging Face directory or a .safetensors file), a path or an fsspec '
        'URL (s3://bucket/run/iter_100.pth; credentials from the environment)',
    )
    parser.add_argument(
        'dst',
        help='the new checkpoint, a path or a URL (must not exist, unless --overwrite; a '
        'directory at a URL is never replaced); DST.safetensors: '
        "the full weights; with --to hf, a directory that transformers' from_pretrained "
        'loads',
    )
    parser.add_argument(
        '--overwrite',
        action='store_true',
        help='replace an existing DST (with its manifest), once SRC has been read and '
        'verified; DST may not be SRC',
    )
    parser.add_argument(
        '--to',
        choices=TARGETS,
        default=None,
        help='target layout (default: safetensors for a .safetensors DST, else file). file: '
        'one verified checkpoint file with its manifest; sharded: a DCP directory with its '
        "manifest (what FSDP's sharded saves write); hf: a directory transformers' "
        'from_pretrained loads, model.safetensors (or shards and model.safetensors.index.json) '
        "and config.json when the checkpoint records the model's config; safetensors: the "
        'full model weights alone, one file',
    )
    parser.add_argument(
        '--max-shard-size',
        default=None,
        metavar='SIZE',
        help="with --to hf: shards of at most SIZE (save_pretrained's max_shard_size: "
        '5GB, 500MB, 2GiB, or bytes) and their index; default: one model.safetensors',
    )


def run(args: argparse.Namespace) -> int:
    from stratagem.progress import count_progress

    try:
        to = args.to or ('safetensors' if args.dst.endswith('.safetensors') else 'file')
        out = convert_checkpoint(
            args.src,
            args.dst,
            to=to,
            progress=count_progress('verifying', sys.stderr),
            overwrite=args.overwrite,
            max_shard_size=args.max_shard_size,
        )
    except (OSError, ValueError, ImportError) as err:
        print(f'stratagem convert: error: {err}', file=sys.stderr)
        return 1
    print(f'wrote {out}')
    return 0
