"""The top floor: the `flywheel` command and `flywheel up`, which start the whole loop on one machine."""
