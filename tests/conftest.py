"""Test set-up: 8 simulated CPU devices, and rule/mesh state restored per test."""

import os
import tempfile

# Compiled figures cached by fsm.fit stay inside this test session, shared by
# its tests, never in the user's ~/.cache.
os.environ['FLAX_SHARDMETA_CACHE'] = tempfile.mkdtemp(prefix='fsm-fit-cache-')

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


@pytest.fixture
def windowed_generations(monkeypatch) -> list[str]:
  """How each parameter generated from its windows was made, in order."""
  from flax_shardmeta import _windowed as windowed

  calls: list[str] = []
  real = windowed.generate_sharded

  def spy(*args, **kwargs):
    calls.append(kwargs.get('how', 'chunks'))
    return real(*args, **kwargs)

  monkeypatch.setattr(windowed, 'generate_sharded', spy)
  return calls


# End-to-end grids run whole in CI (`-m slow`); by default one Auto and one
# Explicit case of each stays, so `make test` is quick and still covers both.
_FAST_CASES = {
  'test_sharded_init.py::test_values_and_layout_match_plain_jitted_init': {
    'auto-lecun-scan',
    'explicit-orthogonal-unrolled',
  },
  'test_notebook_flow.py::test_notebook_flow': {
    'auto-scan-logical',
    'explicit-unrolled-mesh-axes',
  },
}


def pytest_collection_modifyitems(config, items):
  for item in items:
    spec = getattr(item, 'callspec', None)
    key = f'{item.path.name}::{getattr(item, "originalname", "")}'
    fast = _FAST_CASES.get(key)
    if spec is not None and fast is not None and spec.id not in fast:
      item.add_marker(pytest.mark.slow)
