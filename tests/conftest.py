"""Test set-up: 8 simulated CPU devices, and rule/mesh state restored per test."""

import os

# Must happen before jax is imported anywhere in the test session.
os.environ['XLA_FLAGS'] = (
    os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8'
).strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import jax  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

import flax_shardmeta as fsm  # noqa: E402


@pytest.fixture(autouse=True)
def _clean_rule_context():
  """No test sees another test's logical axis rules."""
  fsm.set_logical_axis_rules(())
  yield
  fsm.set_logical_axis_rules(())


@pytest.fixture(params=[AxisType.Auto, AxisType.Explicit], ids=['auto', 'explicit'])
def axis_type(request):
  return request.param


@pytest.fixture
def mesh(axis_type):
  """A (2, 4) ('data', 'model') mesh over the 8 simulated devices."""
  return jax.make_mesh((2, 4), ('data', 'model'), axis_types=(axis_type,) * 2)
