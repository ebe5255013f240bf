import sys

from finetune_tools.results.report import main

sys.exit(main())
