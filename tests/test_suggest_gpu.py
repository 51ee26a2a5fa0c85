"""``fsm.suggest`` on a GPU node this machine does not have: verdicts against
the usable memory of a real run, and the ranking of compile-only GPU programs.

Compiled by jax's CUDA plugin (the ``gpu`` extra) for one node of 8 H100s;
the built-in MLP's training step, whose meshes have Auto axes. The fraction
and reserve are given, so the environment's XLA_CLIENT_MEM_FRACTION does not
change what is asserted.
"""

import json

import pytest

import flax_shardmeta as fsm
from flax_shardmeta._capacity.suggest import ranking
from flax_shardmeta.examples import train

pytestmark = pytest.mark.cuda

MIB = 1 << 20
FRACTION = 'XLA_CLIENT_MEM_FRACTION'


def _search(hbm, lines=None, reserve=0):
  return fsm.suggest(
    train.builder('mlp', batch=64),
    batch=64,
    topology='h100:1x8',
    presets=['fsdp', 'tp'],
    remat=['none', 'full'],
    max_candidates=4,
    progress=lines.append if lines is not None else False,
    hbm=hbm,
    mem_fraction=0.75,
    reserve=reserve,
  )


@pytest.fixture(scope='module')
def roomy():
  # The four compiled layouts with memory to spare: their totals size the
  # GPU below, whatever this XLA makes of them (its cuBLAS workspace differs
  # between releases).
  return _search('1GiB')


def test_no_candidate_over_the_usable_memory_is_called_fitting(roomy):
  # A GPU sized from the layouts' own totals: the smallest fits at fraction
  # 0.75; the reserve leaves the largest fraction room for the second but not
  # for the largest, which fits at no fraction (matmuls compiled as cuBLAS
  # calls, as fit compiles GPUs).
  totals = sorted(c.total_bytes for c in roomy)
  gpu = int(totals[0] / 0.75 * 1.02)
  reserve = max(gpu - (totals[1] + totals[-1]) // 2, 0)
  usable = min(int(0.75 * gpu), gpu - reserve)
  most = min(int(0.95 * gpu), gpu - reserve)
  assert totals[1] > usable and totals[-1] > most, totals
  lines = []
  found = _search(gpu, lines, reserve)
  assert found.hbm_bytes == usable and found.usable.device_bytes == gpu
  for c in found:
    assert c.report.usable.usable_bytes == usable
    if c.fits:
      assert c.total_bytes <= usable, c.label
  between = [c for c in found if usable < c.total_bytes <= most]
  assert between, [(c.label, c.total_bytes) for c in found]
  assert not any(c.fits for c in between)
  raised = found.fitting_with_fraction
  assert raised and all(any(c is b for b in between) for c in raised)
  c = raised[0]
  x = c.report.needed_fraction
  assert 0.75 < x <= 0.95
  assert c.total_bytes <= x * gpu
  marked = f'fits only with {FRACTION}={x:.2f}'
  assert any(
    line.startswith('[') and c.label in line and marked in line for line in lines
  )
  text = str(found)
  assert f'only at {x:.2f}' in text and marked in c.reason
  assert 'judged against usable GPU memory at XLA_CLIENT_MEM_FRACTION=0.75' in text
  row = json.loads(json.dumps(found.to_dict()))['ranked'][found.index(c)]
  assert (row['verdict'], row['needed_fraction']) == ('fits_with_fraction', x)
  assert row['fits'] is False and row['usable_bytes'] == usable
  # Ranked: those that fit, then those a raised fraction holds, then the rest.
  tiers = {'fits': 0, 'fits_with_fraction': 1}
  order = [tiers.get(c.verdict, 2) for c in found]
  assert order == sorted(order) and order.count(0) >= 1 and order.count(2) >= 1
  # The cheap check rejects only what no fraction fit proposes could hold.
  alone = [c for c in found.rejected if 'alone need' in (c.rejected or '')]
  assert alone and all(c.lower_bound > most for c in alone)
  assert 'XLA_CLIENT_MEM_FRACTION=0.95, the largest fraction' in alone[0].rejected


def test_more_remat_never_outranks_the_same_layout_with_less(roomy):
  found = roomy
  assert len(found.fitting) == 4
  position = {(c.preset.name, c.remat): i for i, c in enumerate(found)}
  for preset in ('fsdp', 'tp'):
    assert position[preset, 'none'] < position[preset, 'full'], str(found)
  # By the sort alone the remat twin would rank first: tp's two tie on step
  # time (all-reduces over model) and remat frees memory; fsdp's remat
  # program moves fewer collective bytes.
  plain = sorted(found, key=ranking._rank_key)
  assert any(
    plain.index(c) < plain.index(twin)
    for c in plain
    for twin in plain
    if c.remat == 'full' and twin.remat == 'none' and c.preset == twin.preset
  )
  assert 'more remat only adds recompute' in found[position['tp', 'none']].reason
  # Compile-only GPU programs rank by compute and collective time; their HBM
  # bytes are shown but do not decide.
  for c in found:
    roof = c.report.roofline
    assert c.rank_s == max(roof.compute_s, roof.collective_s)
  assert 'without its HBM term' in found.ranked_by
  assert 'HBM traffic' in str(found)
