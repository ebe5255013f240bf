import sys

from finetune_kit.errors import UserInputError

try:
    if "--smoke" in sys.argv[1:]:  # every CUDA-only path once (gpu_check.smoke)
        from finetune_tools.gpu_check.smoke import main
    else:
        from finetune_tools.gpu_check.runner import main
    sys.exit(main())
except UserInputError as err:
    sys.exit(f"error: {err}")
