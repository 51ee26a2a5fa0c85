"""Copies quiet_libtpu.pth into this interpreter's site-packages (see README.md)."""

import pathlib
import shutil
import sysconfig

source = pathlib.Path(__file__).with_name('quiet_libtpu.pth')
shutil.copy(source, sysconfig.get_paths()['purelib'])
