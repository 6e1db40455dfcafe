"""The `sdpa` command. `sdpa demo` is the main job (`make demo` runs it)."""

from __future__ import annotations

import argparse
import sys


def cmd_demo(args: argparse.Namespace) -> int:
    from sdpa.examples import phrase, unet_attention

    phrase.main(args.seed)
    unet_attention.main(args.size)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sdpa", description="Scaled dot-product attention that shows its work."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="the seed's examples, end to end")
    demo.add_argument("--seed", type=int, default=0, help="seed for the random projections")
    demo.add_argument("--size", type=int, default=64, help="U-Net feature map height and width")
    demo.set_defaults(run=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
