"""Copies the quiet_*.pth files (and the modules they import) into this
interpreter's site-packages (see README.md)."""

import pathlib
import shutil
import sysconfig

here = pathlib.Path(__file__).parent
site = pathlib.Path(sysconfig.get_paths()['purelib'])
shutil.copy(here / 'quiet_libtpu.pth', site)
shutil.copy(here / 'quiet_cuda.pth', site)
shutil.copy(here / 'quiet_cuda.py', site / '_fsm_quiet_cuda.py')
shutil.copy(here / 'quiet_libtpu.py', site / '_fsm_quiet_libtpu.py')
