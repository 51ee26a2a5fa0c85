"""GPU verdicts against the memory a real jax run gives XLA: the allocator's
fraction of the GPU, less what the run holds outside the pool (CUDA context,
NCCL), compiled as that run's compiler plans it. Compile-only H100s from jax's
CUDA plugin; every mesh has Auto axes (fsm.make_mesh's default).
"""

from typing import Any

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import flax_shardmeta as fsm
from flax_shardmeta._capacity.fit import usable

pytestmark = pytest.mark.cuda

GIB = 1 << 30
H100 = 84942979072  # CUDA's total for an H100 80GB, the description's memory


def _held(share: float):
  """A step on one H100 whose arguments alone are ``share`` of the card (its
  other bytes are a few KiB: a fused reduction), so XLA cannot rematerialize
  its way under any limit."""
  mesh = fsm.make_mesh((1,), ('data',), topology='h100:1x1')
  n = int(share * H100) // 4 // 1024 * 1024
  w = jax.ShapeDtypeStruct((n,), jnp.float32, sharding=NamedSharding(mesh, P()))
  step = jax.jit(lambda w: (w * 2.0).sum())
  return mesh, step, w


def _fit(share: float, **kwargs) -> Any:  # a GPU report: its usable rows are set
  mesh, step, w = _held(share)
  with jax.set_mesh(mesh):
    return fsm.fit(step, w, **kwargs)


def test_a_step_at_70_percent_fits_at_the_default_fraction():
  report = _fit(0.70, cache=False)
  assert report.usable.fraction == 0.75 and report.usable.fraction_from == (
    "jax's default"
  )
  assert report.usable.pool_bytes == int(0.75 * H100)
  assert report.hbm_bytes == report.usable.usable_bytes == report.usable.pool_bytes
  assert report.fits is True and report.verdict_kind == 'fits'
  text = str(report)
  assert 'verdict: FITS at XLA_CLIENT_MEM_FRACTION=0.75' in text
  for row in ('GPU memory', 'allocator pool', 'reserve', 'usable'):
    assert f'  {row} ' in text
  # Compiled as a real run compiles it: XLA was handed the pool.
  assert report.plan.retargeted and report.plan.budget_bytes == int(0.75 * H100)


def test_a_step_at_85_percent_fits_only_with_a_raised_fraction():
  report = _fit(0.85, cache=False)
  assert report.fits is False and report.verdict_kind == 'fits_with_fraction'
  assert 0.85 <= report.needed_fraction <= 0.87
  data = report.to_dict()
  assert data['fits'] is False and data['needed_fraction'] == report.needed_fraction
  assert data['verdict'] == 'fits_with_fraction'
  line = next(ln for ln in str(report).splitlines() if ln.startswith('verdict:'))
  assert f'FITS ONLY WITH XLA_CLIENT_MEM_FRACTION={report.needed_fraction:.2f}' in line
  assert 'XLA_PYTHON_CLIENT_MEM_FRACTION' in line
  # The fraction was compiled for and judged by its own program.
  assert any(
    n.startswith('compiled again for XLA_CLIENT_MEM_FRACTION=') for n in (report.notes)
  )


def test_a_step_at_97_percent_does_not_fit():
  report = _fit(0.97, cache=False)
  assert report.fits is False and report.needed_fraction is None
  assert report.verdict_kind == 'does_not_fit'
  assert 'verdict: DOES NOT FIT' in str(report)


def test_mem_fraction_and_the_environment_change_the_compile_and_the_verdict(
  monkeypatch, tmp_path
):
  monkeypatch.setenv('FLAX_SHARDMETA_CACHE', str(tmp_path))
  runs = (
    ({}, {}),
    ({'mem_fraction': 0.9}, {}),
    ({'mem_fraction': 0.9}, {}),
    ({}, {'XLA_CLIENT_MEM_FRACTION': '0.9'}),
    ({}, {'XLA_PYTHON_CLIENT_MEM_FRACTION': '0.9'}),
  )
  reports = []
  for kwargs, env in runs:  # one call site: the cache keys hold source lines
    for name in usable.FRACTION_VARIABLES:
      monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
      monkeypatch.setenv(name, value)
    reports.append(_fit(0.85, **kwargs))
  default, raised, again, from_env, from_old = reports
  assert default.fits is False and not default.cached
  # Another pool is another compile: its own cache entry, not the default's.
  assert raised.fits is True and not raised.cached
  assert raised.plan.budget_bytes == int(0.9 * H100) != default.plan.budget_bytes
  assert again.cached and from_env.cached and from_old.cached
  assert from_env.fits is True
  assert from_env.usable.fraction_from == 'XLA_CLIENT_MEM_FRACTION'
  assert from_old.usable.fraction_from == 'XLA_PYTHON_CLIENT_MEM_FRACTION'
  mesh, step, w = _held(0.85)  # the GPUs are made before the variables change
  monkeypatch.setenv('XLA_CLIENT_MEM_FRACTION', '0.9')
  # jaxlib takes neither of the two: its plugin refuses to start.
  with pytest.raises(fsm.FitError, match='both XLA_CLIENT_MEM_FRACTION'):
    with jax.set_mesh(mesh):
      fsm.fit(step, w)


def test_reserve_decides_a_borderline_case():
  # 93% of the card at fraction 0.95: the pool holds it, but 6 GiB outside
  # the pool (NCCL on a large job) leaves the card too little beside it.
  small = _fit(0.93, mem_fraction=0.95, reserve='1GiB', cache=False)
  assert small.fits is True
  large = _fit(0.93, mem_fraction=0.95, reserve='6GiB', cache=False)
  assert large.fits is False and large.usable.usable_bytes == H100 - 6 * GIB
  assert large.usable.reserve_from == 'reserve='


def test_the_default_reserve_counts_the_programs_communicators():
  mesh = fsm.make_mesh((2, 8), ('data', 'model'), topology='h100:2x8')
  ns = lambda *spec: NamedSharding(mesh, P(*spec))  # noqa: E731
  w = jax.ShapeDtypeStruct((1024, 4096), jnp.float32, sharding=ns(None, 'model'))
  x = jax.ShapeDtypeStruct((256, 1024), jnp.float32, sharding=ns('data', None))
  step = jax.jit(jax.grad(lambda w, x: jnp.tanh(x @ w).sum()))
  with jax.set_mesh(mesh):
    report = fsm.fit(step, w, x, cache=False)
  inside, across = usable.communicators(report.collectives)
  assert (
    report.usable is not None and across >= 1
  )  # the gradient's all-reduce over 'data' crosses nodes
  assert report.usable.reserve_bytes == (
    usable.CONTEXT_BYTES
    + inside * usable.NCCL_IN_NODE_BYTES
    + across * usable.NCCL_ACROSS_NODES_BYTES
  )


def test_the_compiler_plans_against_the_pool_and_says_when_it_rematerializes():
  mesh = fsm.make_mesh((1,), ('data',), topology='h100:1x1')
  d, layers = 4096, 8

  # No matmul: XLA recomputes fused elementwise kernels, not cuBLAS calls
  # (fit compiles GPU matmuls as those).
  def loss(ws, x):
    for w in ws:
      x = jnp.tanh(x - jnp.mean(x, axis=1, keepdims=True)) * w
    return (x.astype(jnp.float32) ** 2).sum()

  ws = [jax.ShapeDtypeStruct((d,), jnp.bfloat16)] * layers
  x = jax.ShapeDtypeStruct((160_000, d), jnp.bfloat16)  # ~1.2 GiB per activation
  step = jax.jit(jax.grad(loss))
  with jax.set_mesh(mesh):
    roomy = fsm.fit(step, ws, x, cache=False)
    tight = fsm.fit(step, ws, x, mem_fraction=0.1, cache=False)
  assert roomy.plan is not None and tight.plan is not None
  assert roomy.memory_analysis is not None and tight.memory_analysis is not None
  assert not roomy.plan.rematerialized
  # A small pool is a different program: XLA recomputes to get under it.
  assert tight.plan.rematerialized and tight.plan.remat_instructions > 0
  assert (
    tight.memory_analysis['temp_size_in_bytes']
    < (roomy.memory_analysis['temp_size_in_bytes'])
  )
  assert any('XLA rematerialized' in n for n in tight.notes)
  assert tight.to_dict()['compiler_plan']['rematerialized'] is True


def test_a_bad_fraction_is_refused_with_the_fix():
  with pytest.raises(fsm.FitError, match='greater than 0 and at most 1, e.g. 0.9'):
    _fit(0.5, mem_fraction=1.5)


def test_needed_fraction_keeps_the_reserve_beside_the_pool():
  m = usable.UsableMemory(100 * GIB, 0.75, "jax's default", 10 * GIB, '')
  assert m.needed_fraction(80 * GIB) == 0.8
  # 92 GiB would need 0.92 of the card, leaving 8 GiB for a 10 GiB reserve.
  assert m.needed_fraction(92 * GIB) is None
  assert m.with_fraction(0.95, '').usable_bytes == 90 * GIB


def test_a_remat_attempt_that_recomputes_nothing_says_so():
  # XLA recomputes no cuBLAS call: a pool too small for a matmul chain gets
  # its "can't reduce" message with no rematerialized instruction.
  from flax_shardmeta._capacity import vocabulary
  from flax_shardmeta._capacity.fit import gpu_verdict

  plan = vocabulary.CompilerPlan(
    budget_bytes=8 * GIB,
    remat_instructions=0,
    remat_target_bytes=6 * GIB,
    message="Can't reduce memory use below 6.00GiB by rematerialization",
  )
  (note,) = gpu_verdict.remat_notes(plan)
  assert 'found nothing to recompute' in note and '8.00 GiB' in note
  assert 'pays recompute' not in note
