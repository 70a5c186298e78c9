"""`python -m lazytrain ...` = `lazytrain ...` (also what `torchrun -m lazytrain` will start)."""

import sys

from lazytrain.cli import main

sys.exit(main())
