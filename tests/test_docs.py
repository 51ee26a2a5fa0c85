"""The documentation site: its generated pages cover the code, its errors page is true.

The module map is written from the code at build time (``docs/_ext``); here
the generator is checked against the package. Every error and warning class
has a section on the errors page (``flax_shardmeta/errors.md``, shipped with
the package and included by ``docs/errors.md``), every message names the
command that prints it, and each message quoted there is produced by the call
described and compared with the text. The whole site builds with warnings as
errors and every link in it leads somewhere (slow: ``make test-slow``).
"""

from __future__ import annotations

import doctest
import html.parser
import inspect
import pathlib
import re
import subprocess
import sys
import textwrap
import threading
import urllib.parse
import warnings
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, AxisType

import flax_shardmeta as fsm
from flax_shardmeta import _errors

ROOT = pathlib.Path(fsm.__file__).resolve().parent.parent
DOCS = ROOT / 'docs'
ERRORS_PAGE = (ROOT / 'flax_shardmeta' / 'errors.md').read_text()
AUTO = (AxisType.Auto,) * 2


# The module map
# ------------------------------------------------------------------------------


def test_the_module_map_covers_every_module(reference):
  named = {m for layer in reference.layers() for m, _ in layer.modules}
  packages = {name for name, _ in reference.packages()}
  modules = reference.package_modules()
  assert modules - named - packages == set(), 'modules the module map leaves out'
  assert (named | packages) - modules == set(), 'the module map names no module'
  assert len(named) == sum(len(layer.modules) for layer in reference.layers()), 'twice'


def test_the_module_map_says_what_each_module_holds(reference):
  for layer in reference.layers():
    for name, summary in layer.modules:
      assert summary and '\n' not in summary, name
  notes = [layer.note for layer in reference.layers() if layer.note]
  assert any(note.startswith('The core') for note in notes), notes
  for name, doc in reference.packages():
    assert doc.strip(), f'flax_shardmeta.{name}: its __init__ has no docstring'


def test_the_pages_use_the_generators():
  modules_page = (DOCS / 'modules.md').read_text()
  assert '.. fsm-module-layers::' in modules_page
  assert '.. fsm-module-packages::' in modules_page
  api_page = (DOCS / 'api.md').read_text()
  assert api_page.count('.. fsm-api-group:: ') >= 10


def test_the_generator_examples_run(reference):
  result = doctest.testmod(reference, optionflags=doctest.ELLIPSIS)
  assert result.attempted and not result.failed


# The errors page
# ------------------------------------------------------------------------------


def _slug(heading: str) -> str:
  """The anchor MyST (``myst_heading_anchors``) and GitHub give a heading."""
  return re.sub(r'[^\w\- ]', '', heading.strip().lower()).replace(' ', '-')


SECTIONS = {
  _slug(m.group(1)): m.group(1)
  for m in re.finditer(r'^## (.+)$', ERRORS_PAGE, re.MULTILINE)
}


def _documented_classes() -> list[type]:
  """Every error and warning class of the errors module."""
  return [
    cls
    for _, cls in inspect.getmembers(_errors, inspect.isclass)
    if cls.__module__ == _errors.__name__
    and issubclass(cls, BaseException)
    and not cls.__name__.startswith('_')
  ]


def test_every_error_and_warning_has_a_section_and_nothing_else_does():
  classes = {cls.__name__ for cls in _documented_classes()}
  assert {'FlaxShardmetaError', 'LaunchError', 'UnmappedNameWarning'} <= classes
  assert set(SECTIONS.values()) == classes


@pytest.mark.parametrize('cls', _documented_classes(), ids=lambda c: c.__name__)
def test_every_message_ends_naming_its_section(cls):
  line = _errors.errors_page_line(cls)
  assert line == f'(what to do: flax-shardmeta explain {cls.__name__})'
  assert cls.__name__.lower() in SECTIONS
  arguments = {fsm.ShardingError: ([],), _errors.LaunchError: ('it failed', [])}
  error = cls(*arguments.get(cls, ('it went wrong',)))
  assert str(error) == f'{_errors.message(error)}\n{line}'
  assert '(what to do' not in _errors.message(error)


@pytest.mark.parametrize('cls', _documented_classes(), ids=lambda c: c.__name__)
def test_the_command_a_message_names_prints_its_section(cls, capsys):
  from flax_shardmeta.cli import main

  command = re.fullmatch(r'\(what to do: (.+)\)', _errors.errors_page_line(cls))
  assert command is not None
  program, *argv = command.group(1).split()
  assert program == 'flax-shardmeta'
  assert main(argv) == 0
  out = capsys.readouterr().out
  section = ERRORS_PAGE.split(f'\n## {cls.__name__}\n', 1)[1].split('\n## ')[0]
  assert out.startswith(f'{cls.__name__}\n{"=" * len(cls.__name__)}\n\n')
  # The prose as written (links keep their text), quoted messages indented.
  first = section.strip().split('\n\n', 1)[0].splitlines()[0]
  assert re.sub(r'\[([^\]]+)\]\([^)]+\)', r'\1', first) in out
  for block in _text_blocks(cls.__name__):
    assert textwrap.indent(block, '    ') in out
  assert '```' not in out


def test_explain_finds_a_section_however_it_is_named(capsys):
  from flax_shardmeta.cli import main

  for name in ('shardingerror', 'fsm.ShardingError', 'docs/errors.md#shardingerror'):
    assert main(['explain', name]) == 0
    assert capsys.readouterr().out.startswith('ShardingError\n')
  assert main(['explain', 'ShardError']) == 2
  err = capsys.readouterr().err
  assert "no section of the errors page is called 'ShardError'" in err
  assert 'did you mean ShardingError' in err
  # No name: every section, one line each.
  assert main(['explain']) == 0
  listed = capsys.readouterr().out.splitlines()[1:]
  assert [line.split()[0] for line in listed] == list(SECTIONS.values())
  assert all(len(line) <= 100 for line in listed)


def test_the_errors_page_ships_with_the_package():
  import importlib.resources
  import tomllib

  page = importlib.resources.files('flax_shardmeta').joinpath('errors.md')
  assert page.read_text() == ERRORS_PAGE
  config = tomllib.loads((ROOT / 'pyproject.toml').read_text())
  assert 'errors.md' in config['tool']['setuptools']['package-data']['flax_shardmeta']
  # The site's page is the package's, included.
  assert '{include} ../flax_shardmeta/errors.md' in (DOCS / 'errors.md').read_text()


def test_a_subclass_made_elsewhere_names_its_base_section():
  from flax_shardmeta import examples

  with pytest.raises(fsm.FlaxShardmetaError) as info:
    examples.model_rules('gpt')
  assert str(info.value).endswith(
    '\n(what to do: flax-shardmeta explain FlaxShardmetaError)'
  )


def test_a_quoted_error_inside_another_message_drops_its_section_line():
  with pytest.raises(fsm.InvalidRulesError) as info:
    fsm.match_partition_rules([('w', (0,))], {'w': jnp.ones((2, 2))})
  # The InvalidNamesError quoted inside keeps no line of its own.
  assert str(info.value).count('(what to do:') == 1
  assert str(info.value).endswith('explain InvalidRulesError)')


# The messages quoted on the errors page, produced as the page describes.


def _message(error: BaseException) -> str:
  kind = type(error)
  return f'{kind.__module__}.{kind.__qualname__}: {error}'


def _raised(kind: type[BaseException], call: Callable[[], object]) -> str:
  with pytest.raises(kind) as info:
    call()
  return _message(info.value)


def _warned(call: Callable[[], object]) -> str:
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    call()
  (warning,) = caught
  return f'{warning.category.__name__}: {warning.message}'


def _sharding_error() -> str:
  mesh = AbstractMesh((2, 4), ('data', 'model'), axis_types=AUTO)
  tree = {'dense': {'kernel': fsm.Partitioned(jnp.zeros((6, 10)), ('data', 'model'))}}
  return _raised(fsm.ShardingError, lambda: fsm.get_sharding(tree, mesh))


def _repeated_names_error() -> str:
  return _raised(
    fsm.InvalidNamesError,
    lambda: fsm.logical_to_mesh_axes(('embed', 'embed'), [('embed', 'data')]),
  )


def _malformed_names_in_a_tree_error() -> str:
  mesh = AbstractMesh((2, 4), ('data', 'model'), axis_types=AUTO)
  tree = {'dense': {'kernel': nn.Partitioned(jnp.zeros((8, 8)), (0, 'model'))}}
  return _raised(fsm.InvalidNamesError, lambda: fsm.get_sharding(tree, mesh))


def _invalid_rules_error() -> str:
  return _raised(
    fsm.InvalidRulesError, lambda: fsm.set_logical_axis_rules([('embed',)])
  )


def _rule_conflict_error() -> str:
  return _raised(
    fsm.RuleConflictError,
    lambda: fsm.composite_rules([('embed', 'data')], [('embed', 'model')]),
  )


def _rule_context_error() -> str:
  context = fsm.logical_axis_rules([('mlp', 'model')])
  seen: list[str] = []

  def exit_elsewhere():
    seen.append(
      _raised(fsm.RuleContextError, lambda: context.__exit__(None, None, None))
    )

  with context:
    loader = threading.Thread(target=exit_elsewhere, name='loader')
    loader.start()
    loader.join()
  return seen[0]


def _no_mesh_error() -> str:
  return _raised(
    fsm.NoMeshError, lambda: fsm.shard_value(jnp.ones((8, 4)), ('data', None))
  )


def _none_mesh_error() -> str:
  tree = {'w': fsm.Partitioned(jnp.zeros(3), ('data',))}
  return _raised(fsm.NoMeshError, lambda: fsm.get_sharding(tree, None))  # type: ignore[arg-type]


def _nnx_jit_error() -> str:
  mesh = jax.make_mesh((2, 4), ('data', 'model'), axis_types=AUTO)
  with jax.set_mesh(mesh):
    model = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

  def train_step(model, optimizer, x):
    grads = nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model)
    optimizer.update(model, grads)

  step = fsm.jit(lambda x: train_step(model, optimizer, x), mesh=mesh)
  return _raised(fsm.NnxJitError, lambda: step(jnp.ones((8, 4))))


def _mesh_shape_error() -> str:
  return _raised(fsm.MeshShapeError, lambda: fsm.make_mesh((3, 4), ('data', 'model')))


def _batch_layout_error() -> str:
  mesh = jax.make_mesh((2, 4), ('data', 'model'), axis_types=AUTO)
  return _raised(fsm.BatchLayoutError, lambda: fsm.data_layout(mesh, 7))


def _topology_error() -> str:
  return _raised(
    fsm.TopologyError, lambda: fsm.make_mesh((4,), ('data',), topology='v5p8')
  )


def _fit_error() -> str:
  return _raised(fsm.FitError, lambda: fsm.fit(lambda x: x, hbm='lots'))


def _indivisible_warning() -> str:
  mesh = AbstractMesh((2, 4), ('data', 'model'), axis_types=AUTO)
  tree = {'kernel': fsm.Partitioned(jnp.zeros((6, 10)), (None, 'model'))}
  return _warned(lambda: fsm.get_sharding(tree, mesh, replicate_indivisible=True))


def _unmapped_names(names: tuple[str, str], rules: list | None) -> Callable[[], str]:
  def generate() -> str:
    mesh = AbstractMesh((2, 4), ('data', 'model'), axis_types=AUTO)
    kernel = jax.ShapeDtypeStruct((4, 8), jnp.float32)
    tree = {'dense': {'kernel': fsm.LogicalPartitioned(kernel, names)}}
    return _warned(lambda: fsm.get_sharding(tree, mesh, rules))

  return generate


def _text_blocks(section: str) -> list[str]:
  """The ```text blocks of the errors page's section ``section``, as written."""
  text = ERRORS_PAGE.split(f'\n## {section}\n', 1)[1].split('\n## ', 1)[0]
  found = re.findall(r'^```text\n(.*?)^```', text, re.MULTILINE | re.DOTALL)
  return [block.rstrip('\n') for block in found]


def _without_flax_wording(text: str) -> str:
  # NnxJitError quotes the first line of flax's own error, worded by flax.
  return re.sub(r"(flax's error: ).*", r'\1...', text)


@pytest.mark.parametrize(
  'section, generate',
  [
    ('ShardingError', _sharding_error),
    ('InvalidNamesError', _repeated_names_error),
    ('InvalidNamesError', _malformed_names_in_a_tree_error),
    ('InvalidRulesError', _invalid_rules_error),
    ('RuleConflictError', _rule_conflict_error),
    ('RuleContextError', _rule_context_error),
    ('NoMeshError', _no_mesh_error),
    ('NoMeshError', _none_mesh_error),
    ('MeshShapeError', _mesh_shape_error),
    ('BatchLayoutError', _batch_layout_error),
    ('TopologyError', _topology_error),
    ('FitError', _fit_error),
    ('IndivisibleDimensionWarning', _indivisible_warning),
    ('UnmappedNameWarning', _unmapped_names(('embed', 'mpl'), [('mlp', 'model')])),
    ('UnmappedNameWarning', _unmapped_names(('embed', 'mlp'), None)),
    (
      'UnmappedMeshAxisNameWarning',
      _unmapped_names(('data', 'mlp'), [('mlp', 'model')]),
    ),
  ],
  ids=lambda value: value if isinstance(value, str) else value.__name__.strip('_'),
)
def test_quoted_message_is_what_is_raised(section, generate):
  assert generate() in _text_blocks(section)


def test_quoted_nnx_jit_error_is_what_is_raised():
  (quoted,) = _text_blocks('NnxJitError')
  assert _without_flax_wording(quoted) == _without_flax_wording(_nnx_jit_error())


MLP_WITHOUT_OUT_SHARDING = textwrap.dedent("""
    import flax.linen as nn, flax_shardmeta as fsm


    class MLP(nn.Module):
      @nn.compact
      def __call__(self, x):
        init = nn.initializers.lecun_normal()
        w1 = fsm.with_logical_partitioning(init, ('embed', 'mlp'))
        w2 = fsm.with_logical_partitioning(init, ('mlp', 'embed'))
        h = nn.relu(nn.Dense(16, kernel_init=w1)(x))
        return nn.Dense(4, kernel_init=w2)(h)
""")


def _explicit_sharding_error(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch):
  (tmp_path / 'mlp.py').write_text(MLP_WITHOUT_OUT_SHARDING)
  monkeypatch.chdir(tmp_path)
  monkeypatch.syspath_prepend(str(tmp_path))
  monkeypatch.delitem(sys.modules, 'mlp', raising=False)
  import mlp  # type: ignore[import-not-found]

  mesh = jax.make_mesh((2, 4), ('data', 'model'), axis_types=(AxisType.Explicit,) * 2)
  rules = [('batch', 'data'), ('mlp', 'model')]
  model = mlp.MLP()
  x = fsm.shard_value(jnp.ones((8, 4)), ('batch', None), rules, mesh)
  with fsm.logical_axis_rules(rules):
    variables = fsm.sharded_init(model.init, mesh)(jax.random.key(0), x)
  forward = fsm.jit(model.apply, mesh=mesh, rules=rules)
  return _raised(fsm.ExplicitShardingError, lambda: forward(variables, x))


def _unnumbered(text: str) -> str:
  # Source line numbers differ between flax releases; the rest must not.
  return re.sub(r'\.py:\d+ in ', '.py:N in ', text)


def test_quoted_explicit_sharding_error_is_what_is_raised(tmp_path, monkeypatch):
  (quoted,) = _text_blocks('ExplicitShardingError')
  generated = _explicit_sharding_error(tmp_path, monkeypatch)
  assert _unnumbered(quoted) == _unnumbered(generated)


# The site
# ------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_site_builds_with_warnings_as_errors(tmp_path, reference):
  pytest.importorskip(
    'sphinx', reason='the docs extra is not installed (make docs installs it)'
  )
  pytest.importorskip('myst_nb', reason='the docs extra is not installed')
  out = tmp_path / 'html'
  done = subprocess.run(
    [sys.executable, '-m', 'sphinx', '-W', '--keep-going', '-q', '-b', 'html']
    + ['-d', str(tmp_path / 'doctrees'), str(DOCS), str(out)],
    capture_output=True,
    text=True,
    timeout=600,
    check=False,
  )
  assert done.returncode == 0, done.stderr[-5000:]
  # The anchors the error messages name are the built page's section ids.
  errors_html = (out / 'errors.html').read_text()
  for cls in _documented_classes():
    assert f'<section id="{cls.__name__.lower()}">' in errors_html, cls
  # A page per public name, its entry there, linked from the API page.
  api_html = (out / 'api.html').read_text()
  for name in reference.public_names():
    page = out / f'{reference.page_name(name)}.html'
    module = reference.row_of(name).kind == 'module'
    anchor = f'{"module-" if module else ""}flax_shardmeta.{name}'
    assert f'id="{anchor}"' in page.read_text(), name
    assert f'href="{reference.page_name(name)}.html#{anchor}"' in api_html, name
  searched = (out / 'searchindex.js').read_text()
  assert '"fsm.fit"' in searched and '"fsm.nnx.shard_module"' in searched
  for notebook in sorted((ROOT / 'notebooks').glob('*.ipynb')):
    assert (out / 'notebooks' / f'{notebook.stem}.html').is_file(), notebook
  # Every link of every page leads to a page of the site and a place on it.
  followed, outside, broken = _follow_links(out)
  assert followed > 1000 and broken == [], broken[:20]
  # Links off the site (none today) would be to the projects the pages cite.
  assert all(link.startswith('https://') for link in outside), sorted(outside)[:5]


class _Links(html.parser.HTMLParser):
  """The ``href``/``src`` links and the element ids of one HTML page."""

  def __init__(self) -> None:
    super().__init__()
    self.links: list[str] = []
    self.ids: set[str] = set()

  def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
    for key, value in attrs:
      if key == 'id' and value:
        self.ids.add(value)
      elif key in ('href', 'src') and value:
        self.links.append(value)


def _follow_links(site: pathlib.Path) -> tuple[int, set[str], list[str]]:
  """Follows each link of the built site's pages: (followed, outside, broken)."""
  pages = {}
  for path in site.rglob('*.html'):
    parser = _Links()
    parser.feed(path.read_text())
    pages[path.resolve()] = parser
  followed, outside, broken = 0, set(), []
  for path, parser in pages.items():
    if path.relative_to(site.resolve()).parts[0] == '_static':
      continue  # the theme's templates, not pages
    for link in parser.links:
      parts = urllib.parse.urlsplit(link)
      if parts.scheme or parts.netloc:
        outside.add(link)
        continue
      target = (path.parent / urllib.parse.unquote(parts.path)).resolve()
      if not parts.path:
        target = path
      if target.is_dir():
        target = target / 'index.html'
      followed += 1
      where = f'{path.relative_to(site.resolve())}: {link}'
      if not target.is_file():
        broken.append(f'{where}: no such file')
      elif parts.fragment and target in pages:
        if urllib.parse.unquote(parts.fragment) not in pages[target].ids:
          broken.append(f'{where}: no such place on the page')
  return followed, outside, broken


MARKDOWN_LINK = re.compile(r'\[[^\]]*\]\(([^)\s]+)\)')


def _markdown_pages() -> list[pathlib.Path]:
  return [
    ROOT / 'README.md',
    ROOT / 'BENCHMARKS.md',
    ROOT / 'dev' / 'README.md',
    ROOT / 'flax_shardmeta' / 'errors.md',
    *sorted(DOCS.rglob('*.md')),
  ]


def _anchors(page: pathlib.Path) -> set[str]:
  text = re.sub(r'^```.*?^```', '', page.read_text(), flags=re.M | re.S)
  return {_slug(m.group(1)) for m in re.finditer(r'^#+ (.+)$', text, re.M)}


def test_every_link_in_the_markdown_leads_somewhere():
  # As GitHub shows the files: relative to each, a heading's anchor its slug.
  followed, broken = 0, []
  for page in _markdown_pages():
    if '_build' in page.parts:
      continue
    text = re.sub(r'^```.*?^```', '', page.read_text(), flags=re.M | re.S)
    for link in MARKDOWN_LINK.findall(text):
      parts = urllib.parse.urlsplit(link)
      if parts.scheme:
        continue
      target = (page.parent / parts.path).resolve() if parts.path else page
      followed += 1
      where = f'{page.relative_to(ROOT)}: {link}'
      if not target.exists():
        broken.append(f'{where}: no such file')
      elif parts.fragment and parts.fragment not in _anchors(target):
        broken.append(f'{where}: no such heading')
  assert followed > 50 and broken == [], broken
