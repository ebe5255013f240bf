import sys

from finetune_kit.results.report import main

sys.exit(main())
