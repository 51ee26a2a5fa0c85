"""Keeps jax's CUDA plugin quiet where no NVIDIA GPU is attached (see README.md).

Installed as ``_fsm_quiet_cuda.py`` beside ``quiet_cuda.pth``, which imports it
at every start of the venv's Python. The work is flax_shardmeta's own
(``_devices/quiet.py``), loaded from its file so that the package itself is
not imported at every start.
"""

import importlib.util
import os

_spec = importlib.util.find_spec('flax_shardmeta')  # finds, runs nothing
for _root in (_spec.submodule_search_locations or []) if _spec else []:
  _path = os.path.join(_root, '_devices', 'quiet.py')
  if os.path.exists(_path):
    _quiet = importlib.util.spec_from_file_location('_fsm_quiet', _path)
    _module = importlib.util.module_from_spec(_quiet)
    _quiet.loader.exec_module(_module)
    _module.quiet_cuda_plugin()
    break
