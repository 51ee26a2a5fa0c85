"""How a report shows itself: a treescope tree in a notebook, else its text.

Plans, restore plans and audits each say what their tree is
(``_treescope_view``) and what their text is (``__str__``); this mixin shows
one or the other. Nothing here imports treescope or IPython until asked.
"""

from __future__ import annotations

import abc
from typing import Any


class ShownWithTreescope(abc.ABC):
  """``_repr_html_`` and ``show()`` from ``_treescope_view()`` and ``str()``."""

  # No instance dictionary of its own: a plan keeps its __slots__.
  __slots__ = ()

  @abc.abstractmethod
  def _treescope_view(self) -> Any:
    """The tree treescope renders."""

  def _repr_html_(self) -> str:
    import treescope

    return treescope.render_to_html(self._treescope_view())

  def show(self) -> None:
    """Displays it as an interactive treescope tree in a notebook (the text
    where only text can be shown).

    Outside a running IPython shell (where treescope has nowhere to display)
    prints the text instead. Whether IPython is merely installed does not
    matter: the decision is made by ``get_ipython()``.
    """
    if ipython_shell() is None:
      print(self)
      return
    from IPython.display import display

    # The text is the plain-text fallback: treescope's own would put whole
    # modules of a plan on one line of several hundred characters.
    display({'text/html': self._repr_html_(), 'text/plain': str(self)}, raw=True)


def ipython_shell() -> Any:
  """The running IPython shell, or None (also when IPython is not installed).

  Example:
    >>> ipython_shell() is None  # a doctest runs outside IPython
    True
  """
  try:
    from IPython import get_ipython
  except ImportError:
    return None
  return get_ipython()
