"""python -m distref.plan"""

import sys

from distref.plan.cli import main

sys.exit(main())
