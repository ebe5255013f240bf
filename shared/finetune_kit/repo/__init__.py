"""Repository tooling: where the repository is (:mod:`.paths`), the generated README blocks (:mod:`.readmes`)."""
