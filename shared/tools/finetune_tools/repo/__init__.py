"""Repository tooling: the generated README blocks (:mod:`.readmes`), whether the pins, the hash locks and the
Dockerfiles agree (:mod:`.pins`)."""
