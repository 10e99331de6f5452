"""`python -m appliance.launcher worker run <instance>`: the launcher without the rest of pdctl's CLI."""
import sys

from .cli import main

sys.exit(main())
