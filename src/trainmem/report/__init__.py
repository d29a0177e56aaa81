"""trainmem.report."""
