"""The audit's printed fixes, pasted into a copy of the source, run.

Each site's fix is the whole statement to write in place of the lines it
names (``site.replaces``), with the imports it says it needs. The helper
here does what a user does with the report: it writes a copy of the model's
module with every fix pasted in, imports it, and runs the step with jax's
plain tracing under Explicit mesh axes, next to the unchanged step under Auto
axes on the same 8 CPU devices. The models (``explicit_fix_models.py``, and
the guide's own example) are written for Auto axes; the step as written is
refused under Explicit ones, and the fixed copy must give the Auto step's
results (the loss and the updated parameters, to 1e-5).
"""

import importlib.util
import pathlib
import re
import sys

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding

import flax_shardmeta as fsm

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import explicit_fix_models as fm  # noqa: E402

GUIDE = HERE.parent / 'docs' / 'guides' / 'explicit_audit.md'


def meshes():
  """The same 8 devices with Auto axes (the step as written) and Explicit."""
  names = ('data', 'model')
  auto = jax.make_mesh((2, 4), names, axis_types=(AxisType.Auto,) * 2)
  explicit = jax.sharding.Mesh(auto.devices, names, axis_types=(AxisType.Explicit,) * 2)
  return auto, explicit


def pasted(source: pathlib.Path, sites, out: pathlib.Path, name: str):
  """The module at ``source`` with every site's fix pasted in, imported."""
  lines = source.read_text().splitlines()
  fixes: dict[tuple[int, int], str] = {}
  imports: set[str] = set()
  for site in sites:
    file, _ = site.where.rsplit(':', 1)
    assert pathlib.Path(file).name == source.name, site.where
    assert site.replaces is not None, f'a fix in words, not code: {site.fix}'
    # Two sites fixing one statement print the same statement.
    assert fixes.setdefault(site.replaces, site.fix) == site.fix
    imports |= set(site.imports)
  for (first, last), fix in sorted(fixes.items(), reverse=True):
    line = lines[first - 1]
    lines[first - 1 : last] = [line[: len(line) - len(line.lstrip())] + fix]
  path = out / f'{name}.py'
  path.write_text('\n'.join([*sorted(imports), *lines]) + '\n')
  return load(path, name)


def load(path: pathlib.Path, name: str):
  """The module at ``path``, imported as ``name``."""
  spec = importlib.util.spec_from_file_location(name, path)
  assert spec is not None and spec.loader is not None
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def concrete(tree, seed):
  """Values for abstract arguments: small normals, token ids below 8."""
  rng = np.random.default_rng(seed)

  def fill(x):
    if np.issubdtype(x.dtype, np.integer):
      values = rng.integers(0, 8, x.shape).astype(x.dtype)
    else:
      values = rng.standard_normal(x.shape).astype(x.dtype) * 0.3
    return jax.device_put(values, x.sharding)

  return jax.tree.map(fill, tree)


def onto(values, mesh):
  """The same values, laid out the same, on ``mesh``."""
  return jax.tree.map(
    lambda v: jax.device_put(v, NamedSharding(mesh, v.sharding.spec)), values
  )


def check_pasted_fixes_run(step, args, fixed_step, explicit, rules=None):
  """The fixed step runs under Explicit axes with jax's own tracing and
  gives the Auto step's outputs; the step as written is refused there."""
  values = concrete(tuple(args), 0)
  auto_out = jax.jit(step)(*values)
  xvalues = onto(values, explicit)
  with jax.set_mesh(explicit), fsm.logical_axis_rules(rules or ()):
    with pytest.raises(Exception, match='(?i)shard|carry'):
      jax.jit(step).trace(*xvalues)  # the test's premise: refused as written
    fixed_out = jax.jit(fixed_step)(*xvalues)
  leaf = jax.tree.leaves(fixed_out)[0]
  assert set(leaf.sharding.mesh.axis_types) == {AxisType.Explicit}
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(
      np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6
    ),
    fixed_out,
    auto_out,
  )


def refused_lines(path: pathlib.Path) -> set[int]:
  lines = path.read_text().splitlines()
  return {i for i, line in enumerate(lines, 1) if line.endswith('# refused')}


# Each case, what it has, and its sites.
CASES = {
  'embed_case': ('an embedding gather, then an addition', 1),
  'index_case': ('an embedding gather by indexing, table[tokens]', 1),
  'optax_case': ('an optax call refused inside, returning another rank', 1),
  'token_loss_case': ('a loss gather inside a scalar mean', 1),
  'repeat_case': ('two jnp.repeat calls on one line', 1),
  'mlp_case': ('a matmul, and an einsum spread over three lines', 2),
  'carry_case': ('a scan whose body moves its carry', 1),
  'linen_case': ('Linen Dense layers made in setup, inline and by name', 3),
  'nnx_case': ('an NNX Linear', 1),
}


@pytest.mark.parametrize('case', list(CASES))
def test_printed_fixes_pasted_into_the_model_run_under_explicit_axes(case, tmp_path):
  auto, explicit = meshes()
  step, *args = getattr(fm, case)(auto)
  report = fsm.audit_explicit(step, *args, rules=fm.RULES)
  models = pathlib.Path(fm.__file__)
  # Each refused line of the case is a site, and only those.
  where = {int(s.where.rsplit(':', 1)[1]) for s in report.sites}
  assert len(where) == CASES[case][1] and where <= refused_lines(models), str(report)
  fixed = pasted(models, report.sites, tmp_path, f'fixed_{case}')
  with jax.set_mesh(explicit), fsm.logical_axis_rules(fm.RULES):
    fixed_step, *_ = getattr(fixed, case)(explicit)
  check_pasted_fixes_run(step, args, fixed_step, explicit, fm.RULES)


def test_each_refused_call_of_a_line_gets_its_fix():
  auto, _ = meshes()
  report = fsm.audit_explicit(*fm.repeat_case(auto), rules=fm.RULES)
  (site,) = report.sites
  assert site.count == 2 and site.fix.count('out_sharding=') == 2, site.fix
  # The scalar loss's gather: the fix is on the gather, not the mean.
  report = fsm.audit_explicit(*fm.token_loss_case(auto), rules=fm.RULES)
  (site,) = report.sites
  assert 'auto_axes(lambda' in site.fix and site.fix.endswith('.mean()'), site.fix
  first, _ = site.replaces or (0, 0)
  assert f'fix, replacing line {first}: {site.fix}' in str(report)


def test_the_guides_example_runs_with_its_printed_fixes(tmp_path):
  # The guide's example as a module: the model and step, then (after the
  # comment naming the mesh) its Auto mesh and abstract arguments.
  text = GUIDE.read_text()
  (block,) = re.findall(r'```python\n(.*?)```', text, re.S)
  model, setup = block.split('report = fsm.audit_explicit')[0].split('# The mesh as')
  path = tmp_path / 'guide_model.py'
  path.write_text(model + '# The mesh as' + setup)
  guide = load(path, 'guide_model')
  report = fsm.audit_explicit(guide.step, guide.params, guide.tokens, rules=guide.RULES)
  assert len(report.sites) == 3, str(report)
  # The fixes go into the model's code; its parameters are today's (made
  # under Auto axes: the fixed model needs Explicit ones in context to run).
  path.write_text(model)
  fixed = pasted(path, report.sites, tmp_path, 'guide_model_fixed')
  _, explicit = meshes()
  check_pasted_fixes_run(
    guide.step, (guide.params, guide.tokens), fixed.step, explicit, guide.RULES
  )


def test_a_refusal_inside_a_helper_of_another_module_is_fixed_there(
  tmp_path, monkeypatch
):
  # The step calls a helper (another module) whose rank-3 gather is refused
  # and which returns a rank-2 value: the fix is the helper's line, with the
  # gather's layout, never the step's line with a spec of the wrong rank.
  auto, explicit = meshes()
  step, *args = fm.helper_case(auto)
  report = fsm.audit_explicit(step, *args, rules=fm.RULES)
  helpers = pathlib.Path(fm.helpers.__file__)
  (site,) = report.sites
  assert int(site.where.rsplit(':', 1)[1]) in refused_lines(helpers), str(report)
  fixed_helpers = pasted(helpers, report.sites, tmp_path, 'fixed_helpers')
  monkeypatch.setitem(sys.modules, 'explicit_fix_helpers', fixed_helpers)
  models = pasted(pathlib.Path(fm.__file__), [], tmp_path, 'models_fixed_helpers')
  with jax.set_mesh(explicit), fsm.logical_axis_rules(fm.RULES):
    fixed_step, *_ = models.helper_case(explicit)
  check_pasted_fixes_run(step, args, fixed_step, explicit, fm.RULES)
