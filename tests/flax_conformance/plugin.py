"""pytest plugin of the flax-test runs: 8 simulated CPU devices, clean rules.

flax's test files set ``XLA_FLAGS`` to 4 devices when imported; the flags are
read when the backend starts, so starting it here, before any test file is
imported, gives every test the same 8 devices as flax_shardmeta's own tests.

Several test files share a process; each starts without logical axis rules
(flax's, and fsm's when loaded), as it would alone: some of flax's tests set
rules and leave them set.
"""

import os
import sys

os.environ['XLA_FLAGS'] = (
  os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8'
).strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import jax  # noqa: E402
import pytest  # noqa: E402
from flax import linen as nn  # noqa: E402

if jax.device_count() != 8:
  raise RuntimeError(
    f'flax conformance runs need 8 simulated CPU devices, got {jax.devices()}; '
    f'XLA_FLAGS={os.environ["XLA_FLAGS"]!r}'
  )


@pytest.fixture(autouse=True, scope='module')
def _no_rules_left_by_another_file():
  nn.set_logical_axis_rules(())
  fsm = sys.modules.get('flax_shardmeta')
  if fsm is not None:
    fsm.set_logical_axis_rules(())
