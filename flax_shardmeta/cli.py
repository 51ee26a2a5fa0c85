"""Command-line interface: ``flax-shardmeta demo``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
  """Entry point of ``flax-shardmeta`` and ``python -m flax_shardmeta``."""
  parser = argparse.ArgumentParser(prog='flax-shardmeta')
  sub = parser.add_subparsers(dest='command', required=True)
  demo = sub.add_parser('demo', help='annotate, lay out, init and train a small model')
  demo.add_argument('--steps', type=int, default=5)
  args = parser.parse_args(argv)
  if args.command == 'demo':
    from flax_shardmeta import demo as demo_lib

    return demo_lib.run(args.steps)
  return 2


if __name__ == '__main__':
  sys.exit(main())
