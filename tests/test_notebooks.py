"""The notebooks in notebooks/ run top to bottom in a real Jupyter kernel.

Each notebook is executed by nbclient in a fresh ``python3`` kernel whose
``PYTHONPATH`` starts with this checkout, so it imports the flax_shardmeta under
test. A failing cell fails the test with that cell's error; the outputs are then
checked for what the notebook is meant to show.

The notebooks are saved with their outputs (the site shows them as saved: its
charts, tables and treescope views). Each run here compares the fresh outputs
with the saved ones in substance: the same outputs of the same kinds in each
cell, the same text with its numbers left out (times and losses move between
runs). The floor's stack saved them, so only the floor compares. After a
change to a notebook or to what it prints, save them again with
``FLAX_SHARDMETA_UPDATE_NOTEBOOKS=1 python -m pytest tests/test_notebooks.py
-m 'slow or not slow'``.
"""

from __future__ import annotations

import copy
import difflib
import os
import pathlib
import re

import nbclient
import nbclient.exceptions
import nbformat
import pytest
from floor import ON_THE_FLOOR

import flax_shardmeta

ROOT = pathlib.Path(flax_shardmeta.__file__).resolve().parent.parent
NOTEBOOKS = ROOT / 'notebooks'
UPDATE = 'FLAX_SHARDMETA_UPDATE_NOTEBOOKS'
"""Set to 1, the notebook tests save the outputs they make instead of comparing."""


def _run(name: str, timeout: int = 300) -> list[str]:
  """Executes notebook ``name``; returns each code cell's text output.

  ``timeout``: seconds any one cell may take.
  """
  nb = nbformat.read(NOTEBOOKS / name, as_version=4)
  saved = copy.deepcopy(nb)
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
  if os.environ.get(UPDATE) == '1':
    _save(nb, NOTEBOOKS / name)
  elif ON_THE_FLOOR:
    _compare(name, _substance(saved), _substance(nb))
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


def _save(nb: nbformat.NotebookNode, path: pathlib.Path) -> None:
  """Writes ``nb`` with its outputs, without what changes at every run."""
  for cell in nb.cells:
    cell.metadata.pop('execution', None)  # nbclient's timestamps
    if cell.cell_type != 'code':
      continue
    # One stream output per run of prints, however the kernel split them.
    merged = []
    for output in cell.outputs:
      last = merged[-1] if merged else None
      if (
        output.output_type == 'stream'
        and last is not None
        and last.output_type == 'stream'
        and last.name == output.name
      ):
        last.text += output.text
      else:
        merged.append(output)
    cell.outputs = merged
  nbformat.validate(nb)
  nbformat.write(nb, path)


NUMBER = re.compile(r'0x[0-9a-f]+|\d+(?:[.,]\d+)*(?:e[-+]?\d+)?')
# Where a kernel's temporary folders print (the fit cache of this session).
TEMPORARY = re.compile(r'/tmp/\S+')


def _substance(nb: nbformat.NotebookNode) -> list[list[str]]:
  """Each code cell's outputs: kind, media types and text without its numbers.

  Pictures and HTML views count by their presence: a chart or a treescope
  view must be there, its pixels and markup may differ. A stream's text is
  one piece however the kernel happened to split it into outputs.
  """
  out = []
  for cell in nb.cells:
    if cell.cell_type != 'code':
      continue
    pieces: list[tuple[str, str]] = []
    for output in cell.outputs:
      if output.output_type == 'stream':
        kind, text = f'[{output.name}]', output.text
        if pieces and pieces[-1][0] == kind:
          text = pieces.pop()[1] + text
        pieces.append((kind, text))
      else:
        kind = f'[{output.output_type}: {" ".join(sorted(output.data))}]'
        html = 'text/html' in output.data
        pieces.append((kind, '' if html else output.data.get('text/plain', '')))
    items = []
    for kind, text in pieces:
      items.append(kind)
      for line in ANSI.sub('', text).splitlines():
        line = TEMPORARY.sub('TMP', NUMBER.sub('#', line))
        items.append(' '.join(line.split()))
    out.append(items)
  return out


def _compare(name: str, saved: list[list[str]], now: list[list[str]]) -> None:
  """Fails with the first cell whose outputs differ from the saved ones."""
  assert len(saved) == len(now), (
    f'{name}: {len(saved)} code cells saved, {len(now)} run'
  )
  for i, (before, after) in enumerate(zip(saved, now)):
    if before != after:
      diff = '\n'.join(difflib.unified_diff(before, after, 'saved', 'now', lineterm=''))
      pytest.fail(
        f'{name}, code cell {i}: the outputs differ from the saved ones in substance '
        f'(save them again with {UPDATE}=1 if the change is meant):\n{diff}',
        pytrace=False,
      )


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


CHARTS = {
  '01_linen_scale_up.ipynb': 0,
  '02_nnx.ipynb': 0,
  '03_plan_a_pod.ipynb': 1,
  '04_will_it_fit.ipynb': 2,
  '05_gpu_clusters.ipynb': 2,
}
"""The charts each notebook draws (its tests count the same)."""


def _markdown(name: str) -> str:
  nb = nbformat.read(NOTEBOOKS / name, as_version=4)
  return '\n'.join(c.source for c in nb.cells if c.cell_type == 'markdown')


def _losses(text: str) -> list[float]:
  return [float(x) for x in re.findall(r'step \d+: loss ([0-9.]+)', text)]


def test_notebooks_are_saved_with_their_outputs():
  names = sorted(p.name for p in NOTEBOOKS.glob('*.ipynb'))
  assert names == [
    '01_linen_scale_up.ipynb',
    '02_nnx.ipynb',
    '03_plan_a_pod.ipynb',
    '04_will_it_fit.ipynb',
    '05_gpu_clusters.ipynb',
  ]
  for name in names:
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == 'code']
    # Run top to bottom, once: the counts are 1, 2, 3...; no cell failed.
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), name
    kinds = {o.output_type for c in code for o in c.outputs}
    assert kinds <= {'stream', 'display_data', 'execute_result'}, (name, kinds)
    assert not any('execution' in c.metadata for c in code), name
    # Each notebook shows what it prints, and each chart it draws.
    assert sum(bool(c.outputs) for c in code) >= len(code) // 2, name
    pictures = sum('image/png' in o.get('data', {}) for c in code for o in c.outputs)
    assert pictures == CHARTS[name], (name, pictures)
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


@pytest.mark.slow
@pytest.mark.cuda
def test_gpu_clusters():
  # Four compiles of the 8B step for H100 clusters, seconds each on 2 cores.
  cells = _run('05_gpu_clusters.ipynb', timeout=600)
  out = '\n'.join(cells)
  sweep = re.findall(
    r'^(\d) node\(s\), +(\d+) GPUs on (\d) host\(s\): +([0-9.]+) GiB per GPU of '
    r'([0-9.]+) usable, (fits|DOES NOT FIT) \(([-+][0-9.]+) GiB\)$',
    out,
    re.M,
  )
  assert [row[:3] for row in sweep] == [
    ('1', '8', '1'),
    ('2', '16', '2'),
    ('4', '32', '4'),
  ]
  sizes = [float(row[3]) for row in sweep]
  hbm = float(sweep[0][4])
  # What a jax run gives XLA: 75% (its default fraction) of CUDA's 79.1 GiB.
  assert hbm == pytest.approx(0.75 * 79.11, abs=0.1)
  assert "usable: 0.75 (jax's default) of 79.1 GiB" in out
  # The same global batch over twice the GPUs: half the memory per GPU.
  assert sizes[1] == pytest.approx(sizes[0] / 2, rel=0.05)
  assert sizes[2] == pytest.approx(sizes[1] / 2, rel=0.05)
  for _, _, _, size, _, verdict, headroom in sweep:
    assert (verdict == 'fits') == (float(size) <= hbm)
    assert float(headroom) == pytest.approx(hbm - float(size), abs=0.11)
  # As the prose says: one node and two do not fit, four do.
  assert [row[5] for row in sweep] == ['DOES NOT FIT', 'DOES NOT FIT', 'fits']
  assert 'NVIDIA H100 80GB HBM3' in cells[2]

  # The full report of the four nodes, with the link of each collective.
  head = 'Will it fit: compiled for NVIDIA H100 80GB HBM3, 32 devices in 4 hosts; '
  assert head + 'mesh data=4, model=8' in out
  assert re.search(
    r'^verdict: FITS at XLA_CLIENT_MEM_FRACTION=0\.75 .*headroom', out, re.M
  )
  assert re.search(
    r'^  usable +59\.33 GiB +min\(pool, GPU memory - reserve\)', out, re.M
  )
  assert re.search(r'^  all-reduce +[0-9,]+ +[0-9.]+ GiB +model +nvlink ', out, re.M)
  assert re.search(r'^  all-gather +[0-9,]+ +[0-9.]+ GiB +data +network ', out, re.M)
  assert re.search(r'^roofline estimate \(h100\): step [0-9.]+ ms', out, re.M)
  # Why: the collectives by reason, with parameters and the model's lines.
  assert 'Why each collective is there' in out and 'What looks unexpected:' in out
  assert re.search(r'^parameter: [0-9.]+ [GMK]iB per chip per step', out, re.M)
  assert re.search(
    r'state/params/layers/\w+ +flax_shardmeta/examples/linen\.py:\d+', out
  )

  steps = re.findall(
    r'^ +([124]) +([0-9.]+) ms +([0-9.]+) ms +([0-9.]+) ms +([0-9.]+) ms +'
    r'(compute|memory|collective) +([0-9.]+) +([0-9.]+)$',
    out,
    re.M,
  )
  assert [row[0] for row in steps] == ['1', '2', '4']
  for _, compute, hbm_s, coll, step, _, _, _ in steps:
    # The roofline's step: the slowest of the three, perfect overlap.
    assert float(step) == pytest.approx(
      max(map(float, (compute, hbm_s, coll))), abs=0.1
    )
  nvlink = [float(row[6]) for row in steps]
  network = [float(row[7]) for row in steps]
  # Tensor parallelism inside a node: its bytes halve with each doubling.
  assert nvlink[1] == pytest.approx(nvlink[0] / 2, rel=0.05)
  assert nvlink[2] == pytest.approx(nvlink[1] / 2, rel=0.05)
  # Data parallelism across nodes: none on one node, about the same from two on.
  assert network[0] == 0 and network[1] > 1
  assert network[2] == pytest.approx(network[1], rel=0.2)
  assert re.search(r'^  1 node\(s\)  all-reduce +over model  nvlink ', out, re.M)
  assert re.search(r'^  4 node\(s\)  all-gather +over data   network ', out, re.M)
  one_node = re.findall(r'^  1 node\(s\) .*$', out, re.M)
  assert one_node and not any('network' in line for line in one_node)
  assert out.count('<image/png>') == 2  # the memory bars; the roofline and links

  remat = re.findall(
    r'^1 node, (no remat|remat full) *: +([0-9.]+) GiB per GPU, fits=(\w+), '
    r'compute +([0-9.]+) ms',
    out,
    re.M,
  )
  assert [row[0] for row in remat] == ['no remat', 'remat full']
  assert remat[1][2] == 'True' and float(remat[1][1]) < hbm
  # "about a fifth more compute"
  assert float(remat[1][3]) / float(remat[0][3]) == pytest.approx(1.2, abs=0.05)
  prose = _markdown('05_gpu_clusters.ipynb')
  assert '**Auto**' in prose and 'NVLink' in prose and 'network' in prose


def test_the_comparison_leaves_numbers_out_and_keeps_the_rest():
  def notebook(*outputs: nbformat.NotebookNode) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell('print(1)', outputs=list(outputs))]
    return nb

  def stream(text: str) -> nbformat.NotebookNode:
    return nbformat.v4.new_output('stream', name='stdout', text=text)

  saved = _substance(notebook(stream('step 0: loss 1.0561\n'), stream('fits (78 s)\n')))
  # Other numbers, the same prints split otherwise: the same in substance.
  assert _substance(notebook(stream('step 0: loss 0.99\nfits (3 s)\n'))) == saved
  _compare('a.ipynb', saved, saved)
  with pytest.raises(pytest.fail.Exception, match=r'code cell 0(.|\n)*\+does not fit'):
    _compare(
      'a.ipynb', saved, _substance(notebook(stream('step 0: loss 1.0\ndoes not fit\n')))
    )
  chart = nbformat.v4.new_output('display_data', data={'text/plain': '<Figure>'})
  with pytest.raises(pytest.fail.Exception, match='display_data'):
    _compare(
      'a.ipynb', saved, _substance(notebook(stream('step 0: loss 1.0\n'), chart))
    )
