"""``python -m flax_shardmeta``: the command-line interface."""

import os
import sys

# The demo runs on 8 simulated CPU devices; the flag must be set before jax
# is imported and only adds host devices, so real accelerators are untouched.
if 'xla_force_host_platform_device_count' not in os.environ.get('XLA_FLAGS', ''):
  os.environ['XLA_FLAGS'] = (
    os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8'
  ).strip()

from flax_shardmeta.cli import main  # noqa: E402

sys.exit(main())
