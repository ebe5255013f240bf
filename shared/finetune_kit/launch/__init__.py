"""What the launcher set up: its environment (:mod:`.env`), checks of the launched DeepSpeed config
against the flags (:mod:`.config_checks`), the Accelerator (:mod:`.accelerator`, gloo on CPU), DeepSpeed's
Muon module imported ahead of its ZeRO check (:mod:`.muon_import`), and the multi-node checks and handshake
(:mod:`.multinode`)."""
