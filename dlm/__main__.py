"""`python -m dlm`: the command line (what torchrun starts: torchrun --nproc-per-node N -m dlm train ...)."""

import sys

from dlm.cli import main

sys.exit(main())
