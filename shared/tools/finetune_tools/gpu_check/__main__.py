import sys

from finetune_kit.errors import UserInputError
from finetune_tools.gpu_check.runner import main

try:
    sys.exit(main())
except UserInputError as err:
    sys.exit(f"error: {err}")
