"""An estimate's verdict carries its measured error: a total within it of the
limit is too close to call without compiling. Abstract meshes with Auto axes
(no compiler asked)."""

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh, AxisType

import flax_shardmeta as fsm
from flax_shardmeta._capacity.estimate.estimator import ERROR_BANDS

MESH = AbstractMesh((2, 4), ('data', 'model'), axis_types=(AxisType.Auto,) * 2)


def _estimate(**kwargs):
  w = fsm.Partitioned(jax.ShapeDtypeStruct((1024, 4096), jnp.float32), (None, 'model'))
  x = fsm.Partitioned(jax.ShapeDtypeStruct((256, 1024), jnp.float32), ('data', None))

  def step(w, x):
    return jnp.tanh(x @ fsm.unbox(w)).sum()

  with jax.sharding.use_abstract_mesh(MESH):
    return fsm.fit(jax.jit(jax.grad(step)), w, x, **kwargs)


def test_a_total_within_the_band_is_too_close_to_call():
  total = _estimate(chip='v5p').total_bytes
  below, above = ERROR_BANDS['tpu']
  close = _estimate(chip='v5p', hbm=int(total * 1.1))
  assert close.error_band == (below, above) and close.too_close_to_call
  assert close.fits is None and close.verdict_kind == 'too_close'
  assert close.to_dict()['fits'] is None and close.to_dict()['verdict'] == 'too_close'
  line = next(ln for ln in str(close).splitlines() if ln.startswith('verdict:'))
  assert line.startswith('verdict: TOO CLOSE TO CALL without compiling')
  assert f'(-{below:.0%}..+{above:.0%})' in line
  # Outside the band either way the estimate decides: the compiled total is
  # at most total / (1 - below) and at least total / (1 + above).
  assert _estimate(chip='v5p', hbm=int(total / (1 - below) * 1.02)).fits is True
  assert _estimate(chip='v5p', hbm=int(total / (1 + above) * 0.98)).fits is False


def test_gpu_estimates_use_the_gpu_band_and_usable_memory():
  report = _estimate(chip='h100')
  assert report.error_band == ERROR_BANDS['gpu']
  assert report.usable is not None and report.usable.fraction == 0.75
  assert report.hbm_bytes == report.usable.usable_bytes


@pytest.mark.parametrize('platform', ['tpu', 'gpu'])
def test_the_bands_are_the_errors_measured_in_benchmarks(platform):
  text = (Path(__file__).parent.parent / 'BENCHMARKS.md').read_text()
  head = {'tpu': '## Will it fit: fsm.fit', 'gpu': '## Will it fit on GPU clusters'}
  section = text[text.index(head[platform]) :]
  section = section[: section.index('Mean absolute error of the total')]
  errors = [int(e) / 100 for e in re.findall(r'\| ([+-]\d+)% \|', section)]
  assert len(errors) >= 8
  below, above = ERROR_BANDS[platform]
  assert below == max(0.0, -min(errors)) and above == max(0.0, max(errors))
