"""Build an AOTInductor package of a DeepSeek V4 checkpoint's steps (:func:`dsv4_compile.export.package`).

Usage:
    python -m dsv4_compile.package_cli --model DIR --out model.pt2 --max-requests 4 --max-seq-len 512

The package holds the model's weights and its ``extend`` and ``decode`` steps for a cache of
``--max-requests`` requests of ``--max-seq-len`` tokens, compiled for ``--device``; run it with
``dsv4_compile.deploy.load`` or the C++ runner (``deploy/cpp``). Bad input ends in one error line
and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .evaluate import InputError
from .evaluate.inputs import check_device, check_output_file, checkpoint_config, load_checkpoint
from .export import PROGRAMS, ExportLimits, default_limits, package
from .model import enable

PROG = "python -m dsv4_compile.package_cli"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, as for every other bad input
        raise InputError(message)


def parse_args(argv=None) -> argparse.Namespace:
    p = _Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True, metavar="DIR", help="checkpoint directory")
    p.add_argument("--out", type=Path, required=True, metavar="FILE", help="the package to write (.pt2)")
    p.add_argument("--max-requests", type=int, default=4, help="concurrent requests of the cache")
    p.add_argument("--max-seq-len", type=int, default=512, help="positions per request (a multiple of 256)")
    p.add_argument("--max-tokens", type=int, help="most query rows a step (default: the runner's token bucket)")
    p.add_argument("--programs", default=",".join(PROGRAMS), help=f"comma-separated, of {', '.join(PROGRAMS)}")
    p.add_argument("--custom-ops", action="store_true",
                   help="keep the dsv4:: ops as custom ops (their CUDA kernels; running needs Python)")
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    if args.out.suffix != ".pt2":
        raise InputError(f"--out {args.out}: a package file ends in .pt2")
    check_output_file("--out", args.out)
    if args.max_tokens is not None and args.max_tokens < 1:
        raise InputError(f"--max-tokens {args.max_tokens}: a step has at least 1 query row")
    args.programs = tuple(args.programs.split(","))
    if not args.programs or any(name not in PROGRAMS for name in args.programs):
        raise InputError(f"--programs {','.join(args.programs)}: expected names from {', '.join(PROGRAMS)}")
    return args


def run(args: argparse.Namespace) -> str:
    device = check_device(args.device)
    try:
        model = load_checkpoint(args.model, checkpoint_config(args.model), device)
        backend = enable(model, max_requests=args.max_requests, max_seq_len=args.max_seq_len)
    except (ValueError, RuntimeError) as e:
        raise InputError(str(e).splitlines()[0]) from None
    limits = default_limits(backend)
    if args.max_tokens is not None:
        limits = ExportLimits(args.max_tokens, limits.max_batch)
    return package(backend, args.out, args.programs, limits=limits, inline_ops=not args.custom_ops)


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
        start = time.perf_counter()
        path = run(args)
    except InputError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path} ({Path(path).stat().st_size / 2**20:.1f} MiB) in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
