import sys

from stallwatch.commands.main import main

sys.exit(main())
