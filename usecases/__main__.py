import sys

from usecases.cli import main

sys.exit(main())
