import sys

from amsp_ext.cli.main import main

sys.exit(main())
