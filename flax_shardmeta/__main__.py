"""``python -m flax_shardmeta``: the command-line interface.

Exactly the ``flax-shardmeta`` console script: each command sets up the
simulated devices it needs itself (``demo`` its 8, ``audit`` one per mesh
device), so nothing is set here.
"""

import sys

from flax_shardmeta.cli import main

sys.exit(main())
