"""python -m glm53_patches.stage: the same as `glm53-patches stage`."""

import sys

from . import main

sys.exit(main())
