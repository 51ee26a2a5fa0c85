"""Deep models in ``fsm.fit``: compiled whole, or from two shallow compiles.

On the 8 simulated CPU devices, Auto mesh axes (as the built-in models are
written for), and an ``AbstractMesh`` of Auto axes for the estimate. The
built-in MLP scans its layers; unrolled, the same layers in a Python loop.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh, AxisType

import flax_shardmeta as fsm
from flax_shardmeta._capacity.fit import extrapolate as ex
from flax_shardmeta.examples import linen, train

AUTO = (AxisType.Auto,) * 2


def cpu_mesh():
  return jax.make_mesh((2, 4), ('data', 'model'), axis_types=AUTO)


class Recorded:
  """``build`` and ``fit_at`` for :func:`ex.fit_layers`, recording the depths
  built and the depths compiled."""

  def __init__(self, mesh, unrolled=False, monkeypatch=None):
    self.mesh, self.built, self.compiled = mesh, [], []
    if unrolled:
      scanned = linen.model

      def model(*args, **kwargs):
        module, example = scanned(*args, **kwargs)
        return module.clone(use_scan=False), example

      monkeypatch.setattr(linen, 'model', model)

  def build(self, n):
    self.built.append(n)
    return train.train_step('mlp', self.mesh, batch=64, dtype=jnp.float32, num_layers=n)

  def fit_at(self, made):
    step, state, batch = made
    self.compiled.append(_depth(state))
    return fsm.fit(step, state, batch)


def _depth(state):
  params = state.params if hasattr(state, 'params') else state['params']
  if 'ScanDotReluDot_0' in params:
    return params['ScanDotReluDot_0']['W2'].value.shape[0]
  return len(params)  # unrolled: one entry per layer


def test_scanned_layers_are_compiled_whole_once():
  made = Recorded(cpu_mesh())
  report, extrapolated = ex.fit_layers(made.build, 8, made.fit_at)
  assert not extrapolated
  assert sorted(made.built) == [2, 4, 8]  # each depth built once
  assert made.compiled == [8]  # the shallow programs were only lowered
  whole = fsm.fit(*made.build(8))
  assert report.rows == whole.rows and report.collectives == whole.collectives
  assert report.method == whole.method + ' (8 layers)'
  assert report.notes[-1].startswith(
    'compiled whole, not extrapolated: the lowered program has '
  )
  assert (
    '(the layers are scanned: the program does not grow with depth)'
    in (report.notes[-1])
  )


def test_extrapolating_scanned_layers_matches_the_whole_compile():
  # Every figure on the line through 2 and 4 layers: exact for scanned ones.
  mesh = cpu_mesh()

  def at(n):
    return fsm.fit(
      *train.train_step('mlp', mesh, batch=64, dtype=jnp.float32, num_layers=n)
    )

  fast = ex.extrapolate(at(2), at(4), 2, 4, 8)
  whole = at(8)
  assert 'extrapolated linearly from compiles at 2 and 4 layers' in fast.method
  assert fast.rows == whole.rows and fast.total_bytes == whole.total_bytes
  assert [(c.kind, c.axes, c.count) for c in fast.collectives] == [
    (c.kind, c.axes, c.count) for c in whole.collectives
  ]
  assert fast.flops == pytest.approx(whole.flops, rel=1e-9)


def test_unrolled_layers_are_extrapolated_when_that_is_clearly_cheaper(monkeypatch):
  made = Recorded(cpu_mesh(), unrolled=True, monkeypatch=monkeypatch)
  report, extrapolated = ex.fit_layers(made.build, 16, made.fit_at)
  assert extrapolated
  assert sorted(made.built) == [2, 4, 16] and made.compiled == [2, 4]
  assert 'extrapolated linearly from compiles at 2 and 4 layers to 16' in (
    report.method
  )
  assert report.notes[-1].startswith('extrapolated, not compiled whole: ')
  whole = fsm.fit(*made.build(16))
  assert report.row('parameters') == whole.row('parameters')
  assert report.row('optimizer state') == whole.row('optimizer state')
  # Not much deeper than 4 layers, one compile is cheaper: done exactly.
  made.built, made.compiled = [], []
  report, extrapolated = ex.fit_layers(made.build, 6, made.fit_at)
  assert not extrapolated and made.compiled == [6]
  assert 'would not cost clearly less than one of all 6' in report.notes[-1]


def test_an_abstract_mesh_is_estimated_whole():
  # Nothing compiles there: two shallow estimates would save nothing.
  made = Recorded(AbstractMesh((2, 4), ('data', 'model'), axis_types=AUTO))
  report, extrapolated = ex.fit_layers(made.build, 8, made.fit_at)
  assert not extrapolated and made.built == [8] and made.compiled == [8]
  assert report.source == 'estimate'
  assert report.notes[-1].startswith('estimated whole, not extrapolated')


def test_exact_and_shallow_models_compile_whole_without_lowering_twice():
  made = Recorded(cpu_mesh())
  _, extrapolated = ex.fit_layers(made.build, 8, made.fit_at, exact=True)
  assert not extrapolated and made.built == [8] and made.compiled == [8]
  made.built, made.compiled = [], []
  ex.fit_layers(made.build, 3, made.fit_at)
  assert made.built == [3] and made.compiled == [3]


@pytest.mark.parametrize(
  'lines, layers, extrapolate',
  [
    ((1575, 1575), 32, False),  # scanned: the program does not grow
    ((256, 464), 6, False),  # unrolled, but hardly deeper
    ((256, 464), 8, False),  # two compiles not clearly cheaper (720 vs 880)
    ((256, 464), 16, True),  # 720 lines against about 1,712
  ],
)
def test_the_decision_reads_the_programs_sizes(lines, layers, extrapolate):
  depths = ex.Depths(2, 4, layers, lines)
  assert depths.extrapolate is extrapolate
  assert depths.note().startswith('extrapolated' if extrapolate else 'compiled whole')


@pytest.mark.parametrize('layers', [0, -2, 2.5, True])
def test_layers_must_be_a_positive_count(layers):
  with pytest.raises(fsm.FitError, match=f'layers={layers!r}'):
    ex.fit_layers(lambda n: None, layers, lambda made: None)


def test_a_builder_returning_something_else_is_named():
  with pytest.raises(fsm.FitError, match='the builder returned int for 8 layers'):
    ex.fit_layers(lambda n: 3, 8, lambda made: None)
