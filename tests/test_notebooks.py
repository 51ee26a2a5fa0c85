"""The notebooks in notebooks/ run top to bottom in a real Jupyter kernel.

Each notebook is executed by nbclient in a fresh ``python3`` kernel whose
``PYTHONPATH`` starts with this checkout, so it imports the flax_shardmeta under
test. A failing cell fails the test with that cell's error; the outputs are then
checked for what the notebook is meant to show.
"""

from __future__ import annotations

import os
import pathlib
import re

import nbclient
import nbclient.exceptions
import nbformat
import pytest

import flax_shardmeta

ROOT = pathlib.Path(flax_shardmeta.__file__).resolve().parent.parent
NOTEBOOKS = ROOT / 'notebooks'


def _run(name: str, timeout: int = 300) -> list[str]:
  """Executes notebook ``name``; returns each code cell's text output.

  ``timeout``: seconds any one cell may take.
  """
  nb = nbformat.read(NOTEBOOKS / name, as_version=4)
  env = dict(os.environ)
  env['PYTHONPATH'] = os.pathsep.join(
    p for p in (str(ROOT), env.get('PYTHONPATH')) if p
  )
  # The kernel has no display. matplotlib's inline backend (ipykernel's default)
  # is headless like Agg but also emits figures, so the test can see them.
  env['MPLBACKEND'] = 'module://matplotlib_inline.backend_inline'
  client = nbclient.NotebookClient(
    nb,
    timeout=timeout,
    kernel_name='python3',
    resources={'metadata': {'path': str(ROOT)}},
  )
  try:
    client.execute(env=env)
  except nbclient.exceptions.CellExecutionError as e:
    pytest.fail(f'{name}: a cell failed:\n{e}', pytrace=False)
  outputs = []
  for cell in nb.cells:
    if cell.cell_type != 'code':
      continue
    text = []
    for out in cell.outputs:
      if out.output_type == 'stream':
        text.append(out.text)
      elif 'data' in out:
        # Each display on its own line, as a notebook shows it.
        text.append(out.data.get('text/plain', '') + '\n')
        if 'image/png' in out.data:
          text.append('<image/png>\n')
    outputs.append(''.join(text))
  _check_line_lengths(name, outputs)
  return outputs


ANSI = re.compile(r'\x1b\[[0-9;]*m')
WIDEST = 150  # a plan table with long names; no more


def _check_line_lengths(name: str, outputs: list[str]) -> None:
  """Text outputs stay readable: no line wider than a wide terminal."""
  for i, text in enumerate(outputs):
    for line in ANSI.sub('', text).splitlines():
      assert len(line) <= WIDEST, f'{name}, code cell {i}: {len(line)} columns'


def test_notebooks_use_only_the_public_api():
  # Public: flax_shardmeta's top level, fsm.nnx and flax_shardmeta.examples.
  private = re.compile(r'flax_shardmeta\.(_|cli)|import cli\b|\bfsm\._|\bcli\.')
  for path in sorted(NOTEBOOKS.glob('*.ipynb')):
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
      found = private.search(cell.source)
      assert not found, f'{path.name}: {found.group(0)!r} is not public'


def _markdown(name: str) -> str:
  nb = nbformat.read(NOTEBOOKS / name, as_version=4)
  return '\n'.join(c.source for c in nb.cells if c.cell_type == 'markdown')


def _losses(text: str) -> list[float]:
  return [float(x) for x in re.findall(r'step \d+: loss ([0-9.]+)', text)]


def test_notebooks_are_committed_without_outputs():
  names = sorted(p.name for p in NOTEBOOKS.glob('*.ipynb'))
  assert names == [
    '01_linen_scale_up.ipynb',
    '02_nnx.ipynb',
    '03_plan_a_pod.ipynb',
    '04_will_it_fit.ipynb',
  ]
  for name in names:
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == 'code']
    assert all(not c.outputs and c.execution_count is None for c in code), name
    # Devices are simulated before jax is imported.
    assert 'xla_force_host_platform_device_count=8' in code[0].source, name
    assert 'import jax' not in code[0].source, name


@pytest.mark.slow
def test_linen_scale_up():
  out = '\n'.join(_run('01_linen_scale_up.ipynb'))
  losses = _losses(out)
  assert len(losses) == 5 and losses[-1] < losses[0], losses
  assert 'Sharding plan: 8 arrays on mesh data=2 x model=4 (8 devices)' in out
  assert "P(None, 'model', None)" in out and 'problems: none' in out
  assert re.search(r'all \d+ arrays match the plan', out)
  assert 'CPU 0,4' in out  # visualize_array_sharding drew the shards


@pytest.mark.slow
def test_nnx():
  out = '\n'.join(_run('02_nnx.ipynb'))
  losses = _losses(out)
  assert len(losses) == 5 and losses[-1] < losses[0], losses
  # shard_module laid the stacked 'layers' axis out over 'data'.
  assert "(4, 1024, 1024) P('data', None, 'model')" in out
  assert re.search(r'after training: all \d+ arrays match the plan', out)
  assert re.search(r'opt_state/0/v_row/layers/W1 +\(4, 1024\) +P\(\)', out)
  assert "['ScanDotReluDot_0']['W2'].value" in out  # the bridged Linen module


def test_plan_a_pod():
  cells = _run('03_plan_a_pod.ipynb')
  out = '\n'.join(cells)
  table = re.findall(
    r'^(T5X 1-D|T5X 2-D|FSDP) +([0-9.]+) GiB +([0-9.]+) GiB +'
    r'([0-9.]+) GiB +(\d+)$',
    out,
    re.MULTILINE,
  )
  assert [row[0] for row in table] == ['T5X 1-D', 'T5X 2-D', 'FSDP']
  totals = {name: float(total) for name, _, _, total, _ in table}
  assert totals['T5X 1-D'] > totals['T5X 2-D'] > totals['FSDP'] > 0
  # FSDP shards every 'embed' dimension 256 ways; only the norms stay whole.
  whole = float(re.search(r'unsharded: ([0-9.]+) GiB in all', out).group(1))
  assert totals['FSDP'] == pytest.approx(whole / 256, rel=0.01)
  assert totals['T5X 2-D'] == pytest.approx(totals['T5X 1-D'] / 32, rel=0.01)
  prose = _markdown('03_plan_a_pod.ipynb')
  assert 'within 1% of a 256th' in prose and 'divides that by\n32' in prose
  for _, params, opt, total, problems in table:
    # adam keeps two moments per parameter.
    assert float(opt) == pytest.approx(2 * float(params), abs=0.02)
    assert float(total) == pytest.approx(float(params) + float(opt), abs=0.02)
    assert problems == '0'
  assert '<image/png>' in out  # the bar chart
  assert 'IndivisibleDimensionWarning - 2 adjustments' in out
  assert "wk: P(None, 'data', 'model', None) -> P(None, 'data', None, None)" in out
  assert "dim 3 'head_dim' -> None: no rule names it, so replicated" in out
  assert 'Sharding plan: 37 arrays on mesh data=32 x model=8 (256 devices)' in cells[-1]


@pytest.mark.slow
@pytest.mark.libtpu
def test_will_it_fit():
  # Each compile of the 8B step takes about a minute on 2 cores; suggest's
  # cell compiles three candidates.
  cells = _run('04_will_it_fit.ipynb', timeout=1200)
  out = '\n'.join(cells)
  assert "{'data': 32, 'model': 4} TPU v5 128 chips" in out
  assert 'Will it fit: compiled for TPU v5, 128 devices in 32 hosts' in out
  sweep = re.findall(r'batch +(\d+): +([0-9.]+) GiB per chip, fits=(\w+)', out)
  assert [b for b, _, _ in sweep][:2] == ['64', '128']
  sizes = [float(x) for _, x, _ in sweep]
  assert sizes == sorted(sizes)  # activations grow with the batch
  assert sweep[-1][2] == 'False'  # the sweep ran until it stopped fitting
  remat = re.search(r'remat full: +([0-9.]+) GiB, fits=(\w+)', out)
  assert remat is not None and float(remat.group(1)) < sizes[-1]
  assert '<image/png>' in out  # the stacked bars
  assert re.search(r'all-gather +over data', out)
  assert re.search(r'estimate [0-9.]+ GiB vs compiled [0-9.]+ GiB', out)
  assert 'exit code 0' in out
  ranked = re.findall(
    r'^(\d)  +(data=\S+(?: \S+=\d+)*)  +(fsdp\+tp|fsdp|tp) ', out, re.M
  )
  assert ranked and ranked[0][0] == '1'
  assert 'mesh and rules for the training script:' in out
  assert out.count('<image/png>') == 2  # the stacked bars and the candidates
