"""Test set-up: 8 simulated CPU devices, and rule/mesh state restored per test."""

import os
import tempfile

# Compiled figures cached by fsm.fit stay inside this test session, shared by
# its tests, never in the user's ~/.cache.
os.environ['FLAX_SHARDMETA_CACHE'] = tempfile.mkdtemp(prefix='fsm-fit-cache-')

# Must happen before jax is imported anywhere in the test session (importing
# this module imports neither jax nor the rest of the package).
from flax_shardmeta._devices.simulated import cpu_device_flags  # noqa: E402

os.environ['XLA_FLAGS'] = cpu_device_flags(os.environ.get('XLA_FLAGS', ''), 8)
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
  from flax_shardmeta._generate import fill

  calls: list[str] = []
  real = fill.generate_sharded

  def spy(*args, **kwargs):
    calls.append(kwargs.get('how', 'chunks'))
    return real(*args, **kwargs)

  monkeypatch.setattr(fill, 'generate_sharded', spy)
  return calls


@pytest.fixture(params=['fast', 'reference'])
def nnx_reading(request):
  """Runs an NNX test with each reading of Variables: the fast path (as the
  probe chose it) and the reference reading it falls back to, forced."""
  from flax_shardmeta._nnx import reading

  if request.param == 'fast':
    yield request.param
    return
  with reading.use_reference_reading():
    yield request.param


def pytest_runtest_setup(item):
  # TPU topologies come from libtpu: the `tpu` extra, which CI installs.
  if item.get_closest_marker('cuda'):
    from flax_shardmeta._devices import gpu

    if not gpu.cuda_plugin_available():
      pytest.skip(
        "jax's CUDA plugin is not installed "
        "(pip install '.[gpu]' from a checkout; CI has it)"
      )
  if item.get_closest_marker('libtpu'):
    from flax_shardmeta._devices import topology

    if not topology.libtpu_available():
      pytest.skip(
        "libtpu is not installed (pip install '.[tpu]' from a checkout; CI has it)"
      )


@pytest.fixture(autouse=True)
def _reports_read_right(monkeypatch):
  """Every report any test makes names only the user's lines (no source of a
  collective row lies in jax, flax, optax or flax_shardmeta itself), and was
  read from a program text the reader read as XLA's own module has it."""
  from flax_shardmeta import _frames
  from flax_shardmeta._capacity import report

  made = []
  real = report.FitReport.__init__

  def keep(self, *args, **kwargs):
    real(self, *args, **kwargs)
    made.append(self)

  monkeypatch.setattr(report.FitReport, '__init__', keep)
  yield
  library = sorted(
    {
      source
      for made_report in made
      for row in made_report.collectives
      for source in row.sources
      if _frames.is_library_file(source.rpartition(':')[0])
    }
  )
  assert not library, f'collectives attributed to library lines: {library}'
  # The HLO reader agrees with XLA's own module on every program compiled.
  disagreeing = [
    note
    for made_report in made
    for note in made_report.notes
    if 'reader disagrees' in note
  ]
  assert not disagreeing, disagreeing


@pytest.fixture(scope='session')
def reference():
  """``docs/_ext/fsm_reference.py``: what the reference pages list (no Sphinx)."""
  import importlib.util
  import pathlib
  import sys

  path = pathlib.Path(__file__).parents[1] / 'docs' / '_ext' / 'fsm_reference.py'
  spec = importlib.util.spec_from_file_location('fsm_reference', path)
  assert spec and spec.loader
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # dataclasses look their module up there
  spec.loader.exec_module(module)
  return module
