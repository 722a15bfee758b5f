"""The top floor: the `flywheel` command and `flywheel up`, which start the whole loop on one machine."""

from flywheel.allocator import keep_freed_pages

# Before anything below loads polars: its allocator reads its settings once (`flywheel.allocator`).
keep_freed_pages()
