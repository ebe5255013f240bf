"""What the launcher set up: its environment (:mod:`.env`), checks of the launched DeepSpeed config
against the flags (:mod:`.config_checks`), the Accelerator (:mod:`.accelerator`, gloo on CPU), the
start-up speed-ups for CPU launches (:mod:`.startup`), and the multi-node checks and handshake
(:mod:`.multinode`)."""
